"""PipelineTrainer (ART's `art.pipeline_trainer`): rollouts for the next steps run while a step trains, with a
bound on how stale the policy behind a trained rollout may be, and that staleness recorded for every step.

    from artnb.pipeline_trainer import PipelineTrainer, make_group_rollout_fn
    trainer = PipelineTrainer(model, backend, make_group_rollout_fn(rollout, n=8), scenarios, config=None,
                              min_batch_size=4, max_steps_off_policy=1, max_steps=20, learning_rate=1e-5)
    await trainer.train()

How it runs (on the notebook's event loop; the step itself trains on the backend's trainer thread):
- `num_rollout_workers` workers take scenarios in order and call `rollout_fn(model, scenario, config)`, which
  returns a TrajectoryGroup. Each trajectory records the step serving when its group began and when it ended
  (`initial_policy_version`, `final_policy_version`).
- The trainer waits for `min_batch_size` finished groups, takes up to `max_batch_size` of them (those begun on
  the oldest policy first, then in scenario order) and trains one step on them.
- The bound: a group begun at step v and trained at step t is t - v steps off-policy. A worker starts a rollout
  only if, counting the groups already ahead of it, it would be trained within `max_steps_off_policy` steps; a
  group still too old when its batch is taken is dropped. With 0 this is the synchronous gather -> train loop.
- Each step's history row holds `train/steps_off_policy` (mean) and `_max`, `train/ratio_std` (the importance
  ratios' spread, which the lag widens), `train/discarded_stale_groups`, `throughput/step_trainer_idle_s` (the
  trainer waiting for rollouts), `throughput/step_actor_idle_s` (no rollout running), and `time/step_wall_s`.
  The TrainingPanel plots lag and ratio spread.

Inference is held while a step trains (LocalBackend on one device), so requests made then wait and run on the new
adapter; what overlaps is everything else a rollout does (tools, environments, judges) and the queue refilling.

A kill -9 loses nothing committed: a step's checkpoint, row and rollouts commit together (backends/train_step.py),
and after each commit the model's state.json records which scenarios are finished (trained, dropped or failed:
every one before an offset, and the few after it). A restart skips those and rolls the rest out again: a group
that was in flight or waiting is redone, never lost, and none is trained twice. Had the process died between a
commit and that record, one batch's scenarios are trained again (a warning says so).

Differences from ART: `max_steps` counts steps from where `train()` starts, as ART; every step writes a checkpoint
(`save_checkpoint=False` is reported as ignored), and `checkpoint_retention_strategy` (e.g. `keep_recent_and_top()`)
deletes old ones on a LocalBackend; there is no autotuner (`autotune=` is reported); status lines are a progress
bar; a rollout that raises is counted and warned about, and a long run of failures with no group finished stops the
trainer with the last error.
"""

from __future__ import annotations

import asyncio
import math
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from .core import metric_names as names
from .core.config import TrainConfig, resolve_train_config
from .core.ignored import report_ignored, warn_user
from .core.model import NothingToTrainError, TrainableModel
from .core.pipeline_config import PipelineAutotuneConfig, PipelineRuntimeConfig, resolve_pipeline
from .core.retention import (
    CheckpointInfo,
    CheckpointRetentionContext,
    CheckpointRetentionStrategy,
    keep_recent_and_top,
)
from .core.trajectory import Trajectory, TrajectoryGroup

RolloutFn = Callable[[TrainableModel, Any, Any], Awaitable[TrajectoryGroup]]
SingleRolloutFn = Callable[[TrainableModel, Any, Any], Awaitable[Trajectory]]
EvalFn = Callable[[TrainableModel, int, Any], Awaitable[Any]]
# In the model's state.json: {"step", "scenario_offset", "finished_after_offset": [scenario indices]}
STATE_KEY = "_pipeline_trainer"


def make_group_rollout_fn(single_rollout_fn: SingleRolloutFn, n: int = 4) -> RolloutFn:
    """A group rollout from a one-trajectory rollout: `n` runs on the same scenario, failures kept in the group's
    `exceptions`."""
    if n < 1:
        raise ValueError(f"n={n}: a group needs at least one rollout")

    async def group_rollout(model: TrainableModel, scenario: Any, config: Any) -> TrajectoryGroup:
        return await TrajectoryGroup(single_rollout_fn(model, scenario, config) for _ in range(n))

    return group_rollout


@dataclass
class PipelineSummary:
    """What one `train()` call did."""

    steps: int = 0  # steps trained
    groups_trained: int = 0
    stale_groups_discarded: int = 0
    failed_rollouts: int = 0  # rollout_fn calls that raised or returned no trajectory
    final_step: int = 0


@dataclass
class _Finished:
    index: int  # the scenario's position in `scenarios`
    group: TrajectoryGroup
    version: int  # the step serving when the rollout began


class PipelineTrainer:
    """Overlapped rollouts and training with a staleness bound (see the module docstring)."""

    def __init__(
        self,
        model: TrainableModel,
        backend: Any,
        rollout_fn: RolloutFn,
        scenarios: Iterable[Any] | AsyncIterator[Any],
        config: Any = None,
        eval_fn: EvalFn | None = None,
        *,
        num_rollout_workers: int | None = None,
        min_batch_size: int | None = None,
        max_batch_size: int | None = None,
        max_steps_off_policy: int | None = 4,
        queue_maxsize: int | None = None,
        pipeline: PipelineRuntimeConfig | None = None,
        autotune: PipelineAutotuneConfig | None = None,
        learning_rate: float | None = None,
        loss_fn: str | None = None,
        loss_fn_config: dict | None = None,
        normalize_advantages: bool = True,
        grad_accumulation_sequences: int | None = None,
        adam_params: Any = None,
        kl_penalty_coef: float = 0.0,
        kl_penalty_step_lag: int | None = None,
        packed_sequence_length: int | None = None,
        max_steps: int | None = None,
        discard_queue_multiplier: int = 100,
        limit_mean_steps_off_policy: float | None = None,
        score_reference_groups_per_step: float | None = None,
        score_reference_rollouts_per_group: float | None = None,
        log_interval_seconds: float = 60.0,
        status_ewa_alpha: float = 0.2,
        total_scenarios: int | None = None,
        eval_every_n_steps: int = 20,
        eval_at_start: bool = True,
        save_checkpoint: bool = True,
        optimizer_save_interval: int = 5,
        checkpoint_retention_strategy: CheckpointRetentionStrategy | None = None,
        checkpoint_retention_interval: int = 1,
        resume: bool = True,
        rollout_executor: Any = None,
        train_config: TrainConfig | None = None,
        plots: Sequence[Any] = (),
    ) -> None:
        """`learning_rate` and `loss_fn` default to ART's (1e-5, "cispo") unless `train_config` (artnb's
        TrainConfig for every step) sets them; ART's other training keywords (`kl_penalty_coef`,
        `grad_accumulation_sequences`, `optimizer_save_interval`...) mean what they mean in `backend.train`.
        `pipeline=PipelineRuntimeConfig(...)` holds the worker and batch settings (ART 0.5.23's spelling; the
        keywords `num_rollout_workers`, `min_batch_size`, `max_batch_size`, `queue_maxsize` still work, not both).
        `limit_mean_steps_off_policy`: also drop a group whose trajectories' mean lag exceeds it (with
        `max_steps_off_policy=None` it alone bounds the lag). `checkpoint_retention_strategy` (e.g.
        `keep_recent_and_top()`), every `checkpoint_retention_interval` steps, deletes the checkpoints it does
        not keep, never the newest nor one that rollouts in flight may have come from. `config` is yours, passed to
        `rollout_fn` and `eval_fn`. `plots`: widgets refreshed after every step, e.g.
        `[art.widgets.RewardPlot(model), art.widgets.OffPolicyPlot(model)]`."""
        runtime = resolve_pipeline(
            pipeline,
            autotune,
            dict(
                num_rollout_workers=num_rollout_workers,
                min_batch_size=min_batch_size,
                max_batch_size=max_batch_size,
                queue_maxsize=queue_maxsize,
            ),
            dict(
                score_reference_groups_per_step=score_reference_groups_per_step,
                score_reference_rollouts_per_group=score_reference_rollouts_per_group,
            ),
        )
        checks = {
            "max_steps_off_policy": max_steps_off_policy is None or max_steps_off_policy >= 0,
            "limit_mean_steps_off_policy": limit_mean_steps_off_policy is None
            or limit_mean_steps_off_policy >= 0,
            "max_steps": max_steps is None or max_steps >= 1,
            "eval_every_n_steps": eval_every_n_steps >= 1,
            "checkpoint_retention_interval": checkpoint_retention_interval >= 1,
            "kl_penalty_step_lag": kl_penalty_step_lag is None or kl_penalty_step_lag >= 1,
        }
        if bad := [name for name, ok in checks.items() if not ok]:
            raise ValueError(
                f"PipelineTrainer: invalid {', '.join(bad)} (the off-policy limits are None or >= 0, max_steps "
                "None or >= 1, the intervals >= 1, kl_penalty_step_lag None or >= 1)"
            )
        if not callable(rollout_fn):
            raise TypeError(
                "rollout_fn must be `async def rollout_fn(model, scenario, config) -> TrajectoryGroup`"
            )
        self.model, self.backend, self.rollout_fn, self.eval_fn = model, backend, rollout_fn, eval_fn
        self.scenarios, self.config = scenarios, config
        self.pipeline = runtime
        self.num_rollout_workers = runtime.num_rollout_workers
        self.min_batch_size, self.max_batch_size = runtime.min_batch_size, runtime.batch_limit
        self.max_steps_off_policy = max_steps_off_policy
        self.limit_mean_steps_off_policy = limit_mean_steps_off_policy
        self.queue_maxsize = runtime.queue_maxsize
        self.max_steps = max_steps
        self.eval_every_n_steps, self.eval_at_start = eval_every_n_steps, eval_at_start
        self.resume = resume
        # ART's status-line knobs (discard_queue_multiplier, log_interval_seconds, status_ewa_alpha,
        # total_scenarios): a progress bar replaces them here
        options: dict[str, Any] = {
            "normalize_advantages": normalize_advantages,
            "loss_fn_config": loss_fn_config,
            "adam_params": adam_params,
            "packed_sequence_length": packed_sequence_length,
        }
        # ART's defaults (None, 5) change nothing here; passed on only when set, so a train_config's own stay
        if grad_accumulation_sequences is not None:
            options["grad_accumulation_sequences"] = grad_accumulation_sequences
        if optimizer_save_interval != 5:
            options["optimizer_save_interval"] = optimizer_save_interval
        if kl_penalty_coef:
            options["kl_penalty_coef"] = kl_penalty_coef
        given = train_config.model_fields_set if train_config is not None else set()
        if learning_rate is not None or "learning_rate" not in given:
            options["learning_rate"] = learning_rate if learning_rate is not None else 1e-5
        if loss_fn is not None or "loss_fn" not in given:
            options["loss_fn"] = loss_fn or "cispo"
        self.train_config = resolve_train_config(train_config, options)
        self.checkpoint_retention_strategy = _retention_on(backend, checkpoint_retention_strategy)
        if self.checkpoint_retention_strategy and max_steps_off_policy is limit_mean_steps_off_policy is None:
            report_ignored(
                "PipelineTrainer(checkpoint_retention_strategy=...) without an off-policy bound",
                "with max_steps_off_policy and limit_mean_steps_off_policy both None a rollout may come from any "
                "step, so no checkpoint can be deleted safely; set max_steps_off_policy",
            )
        self.checkpoint_retention_interval = checkpoint_retention_interval
        _report_ignored_keywords(save_checkpoint, kl_penalty_step_lag, rollout_executor)
        self.plots = list(plots)
        self._stop_requested = False
        self._running = False

    def request_stop(self) -> None:
        """Stop after the step in progress (rollouts in flight are abandoned; a restart redoes them)."""
        self._stop_requested = True
        run = getattr(self, "_run", None)
        if run is not None:
            run.loop.call_soon_threadsafe(run.wake)

    async def train(self, *, handle_signals: bool = True) -> PipelineSummary:
        """Run until `max_steps` steps are trained, the scenarios run out, or `request_stop()`.

        `handle_signals`: in a script, Ctrl-C / SIGTERM ask for a graceful stop (as `request_stop()`); in a
        notebook the kernel's interrupt cancels the cell instead, which stops the same way (a step already
        training commits first)."""
        if self._running:
            raise RuntimeError("this PipelineTrainer is already training; await the first train() call")
        self._running, self._stop_requested = True, False
        loop = asyncio.get_running_loop()
        installed = _install_signal_handlers(loop, self.request_stop) if handle_signals else []
        try:
            run = self._run = await _Run.start(self, loop)
            return await run.run()
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)
            self._running, self._run = False, None


class _Run:
    """One `train()` call: the shared state of the workers and the trainer, guarded by one condition."""

    def __init__(
        self, owner: PipelineTrainer, loop: asyncio.AbstractEventLoop, step: int, offset: int, done: set[int]
    ) -> None:
        self.owner, self.loop, self.model = owner, loop, owner.model
        self.cond = asyncio.Condition()
        self.version = step  # the step being served (policy version)
        self.training = False
        self.in_flight = 0
        self.ready: list[_Finished] = []
        self.exhausted = False
        self.fatal: BaseException | None = None
        self.offset = offset  # scenarios [0, offset) are finished
        self.done = set(done)  # and these after it
        self.next_index = 0
        self.failures_in_a_row = 0
        self.summary = PipelineSummary(final_step=step)
        self.actor_idle_s, self.idle_since = 0.0, time.monotonic()
        self.step_started = time.monotonic()
        self.stale_this_step = 0
        self.evals: list[asyncio.Task] = []
        self.evaluating: set[int] = set()  # steps whose evaluation runs: their checkpoints are kept
        self.bar = tqdm(total=owner.max_steps, desc="pipeline", unit="step")
        self._iter = _scenario_iterator(owner.scenarios)

    @classmethod
    async def start(cls, owner: PipelineTrainer, loop: asyncio.AbstractEventLoop) -> _Run:
        model = owner.model
        step = await model.get_step()
        offset, done = 0, set()
        if owner.resume:
            state = ((await asyncio.to_thread(model.read_state)) or {}).get(STATE_KEY) or {}
            offset = int(state.get("scenario_offset", 0))
            done = {int(i) for i in state.get("finished_after_offset", [])}
            if state and int(state.get("step", step)) != step:
                warn_user(
                    f"artnb: PipelineTrainer resumes at step {step}, but its scenario position was saved at step "
                    f"{state.get('step')} (the process stopped between a commit and that save): the scenarios "
                    "after that save are rolled out again"
                )
        return cls(owner, loop, step, offset, done)

    def wake(self) -> None:
        asyncio.ensure_future(self._notify())

    async def _notify(self) -> None:
        async with self.cond:
            self.cond.notify_all()

    # the run ---------------------------------------------------------------------------------------------
    async def run(self) -> PipelineSummary:
        owner = self.owner
        if owner.eval_fn is not None and owner.eval_at_start:
            self.evals.append(asyncio.ensure_future(self._evaluate(owner.eval_fn, self.version)))
        workers = [asyncio.ensure_future(self._worker()) for _ in range(owner.num_rollout_workers)]
        try:
            await self._trainer()
        finally:
            async with self.cond:
                self.exhausted = True  # workers start nothing more
                self.cond.notify_all()
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            if self.evals:
                await asyncio.gather(*self.evals, return_exceptions=True)
            self.bar.close()
        return self.summary

    # rollouts --------------------------------------------------------------------------------------------
    def _lag_if_started_now(self) -> int:
        """How many steps off-policy a rollout started now would be when trained, at the earliest."""
        next_step = self.version + (1 if self.training else 0)
        ahead = self.in_flight + len(self.ready)
        return next_step - self.version + ahead // self.owner.max_batch_size

    def _may_start(self) -> bool:
        queue_room = self.owner.queue_maxsize is None or len(self.ready) < self.owner.queue_maxsize
        bound = self._start_bound()
        return queue_room and (bound is None or self._lag_if_started_now() <= bound)

    def _start_bound(self) -> int | None:
        """The lag a rollout started now may reach: max_steps_off_policy, else the mean limit rounded up (a
        group's mean lag cannot stay within it if its first rollout is further behind), else none."""
        owner = self.owner
        if owner.max_steps_off_policy is not None:
            return owner.max_steps_off_policy
        limit = owner.limit_mean_steps_off_policy
        return None if limit is None else math.ceil(limit)

    def _too_stale(self, finished: _Finished) -> bool:
        """Whether a group is past either bound when trained now: its oldest rollout for max_steps_off_policy,
        the mean lag of its trajectories for limit_mean_steps_off_policy."""
        owner = self.owner
        if (
            owner.max_steps_off_policy is not None
            and finished.version < self.version - owner.max_steps_off_policy
        ):
            return True
        if owner.limit_mean_steps_off_policy is None:
            return False
        lags = [
            self.version
            - (t.initial_policy_version if t.initial_policy_version is not None else finished.version)
            for t in finished.group.trajectories
        ]
        return sum(lags) / len(lags) > owner.limit_mean_steps_off_policy

    async def _next_scenario(self) -> tuple[int, Any] | None:
        while True:
            try:
                scenario = await self._iter.__anext__()
            except StopAsyncIteration:
                return None
            index, self.next_index = self.next_index, self.next_index + 1
            if index < self.offset or index in self.done:  # finished before a restart
                continue
            return index, scenario

    async def _worker(self) -> None:
        owner = self.owner
        while True:
            async with self.cond:
                while not (self.exhausted or self.fatal or owner._stop_requested) and not self._may_start():
                    await self.cond.wait()
                if self.exhausted or self.fatal or owner._stop_requested:
                    return
                item = await self._next_scenario()
                if item is None:
                    self.exhausted = True
                    self.cond.notify_all()
                    return
                if self.in_flight == 0:
                    self.actor_idle_s += time.monotonic() - self.idle_since
                self.in_flight += 1
                version = self.version
            index, scenario = item
            group: Any = None
            error: BaseException | None = None
            try:
                with self.model.activate_metrics_context("train"):
                    group = await owner.rollout_fn(self.model, scenario, owner.config)
                if not isinstance(group, TrajectoryGroup):
                    raise TypeError(
                        f"rollout_fn returned {type(group).__name__}; it must return an art.TrajectoryGroup "
                        "(wrap a one-trajectory rollout with make_group_rollout_fn(rollout, n=...))"
                    )
            except asyncio.CancelledError:
                raise
            except Exception as e:
                error = e
            async with self.cond:
                self.in_flight -= 1
                if self.in_flight == 0:
                    self.idle_since = time.monotonic()
                if error is None and group.trajectories:
                    initial: list[int] = []
                    for t in group.trajectories:
                        if t.initial_policy_version is None:
                            t.initial_policy_version = version
                        if t.final_policy_version is None:
                            t.final_policy_version = self.version
                        initial.append(t.initial_policy_version)
                    first = min(initial)
                    self.ready.append(_Finished(index, group, first))
                    self.failures_in_a_row = 0
                else:
                    # a TypeError: rollout_fn returns the wrong thing, and every call will
                    fatal = isinstance(error, TypeError)
                    self._rollout_failed(index, error or _no_trajectories(group), fatal)
                self.cond.notify_all()

    def _rollout_failed(self, index: int, error: BaseException, fatal: bool) -> None:
        self.summary.failed_rollouts += 1
        self.failures_in_a_row += 1
        self._finish(index)
        if self.summary.failed_rollouts == 1 and not fatal:
            warn_user(
                f"artnb: PipelineTrainer: a rollout failed ({type(error).__name__}: {error}); it is skipped"
            )
        limit = max(8, 2 * self.owner.num_rollout_workers)
        if fatal or self.failures_in_a_row >= limit:
            self.fatal = RuntimeError(
                f"PipelineTrainer stopped: {self.failures_in_a_row} rollouts in a row failed; the last: "
                f"{type(error).__name__}: {error}"
            )
            self.fatal.__cause__ = error

    def _finish(self, index: int) -> None:
        """Scenario `index` needs no more work; the saved offset moves over every finished scenario in order."""
        self.done.add(index)
        while self.offset in self.done:
            self.done.discard(self.offset)
            self.offset += 1

    # training --------------------------------------------------------------------------------------------
    async def _trainer(self) -> None:
        owner = self.owner
        while owner.max_steps is None or self.summary.steps < owner.max_steps:
            waited = time.monotonic()
            batch = await self._take_batch()
            if batch is None:
                return
            if not batch:
                continue
            trainer_idle_s = time.monotonic() - waited
            builder = self.model.metrics_builder()
            builder.add_idle_times(
                step_trainer_idle_s=trainer_idle_s, step_actor_idle_s=self._take_actor_idle()
            )
            builder.add_metric(names.trainer("discarded_stale_groups"), self.stale_this_step)
            builder.add_user_timing(step_wall_s=time.monotonic() - self.step_started)
            self.stale_this_step = 0
            groups = [f.group for f in batch]
            try:
                result = await self.owner.backend.train(self.model, groups, config=owner.train_config)
            except NothingToTrainError as error:
                warn_user(f"artnb: PipelineTrainer: a batch had nothing to train on ({error}); it is skipped")
                result = None
            except BaseException:
                async with self.cond:
                    self.training = False
                    self.cond.notify_all()
                raise
            async with (
                self.cond
            ):  # the new policy and the end of training at once: the bound never sees one alone
                self.training = False
                if result is not None:
                    self.version = result.step
                self.cond.notify_all()
            for f in batch:
                self._finish(f.index)
            if result is None:
                continue
            self.step_started = time.monotonic()
            self.summary.steps += 1
            self.summary.groups_trained += len(batch)
            self.summary.final_step = result.step
            position = {
                "step": result.step,
                "scenario_offset": self.offset,
                "finished_after_offset": sorted(self.done),
            }
            await asyncio.to_thread(self.model.merge_state, {STATE_KEY: position})
            self._show(result.metrics)
            for plot in owner.plots:
                try:
                    plot.refresh()
                except Exception as error:  # a plot must never stop training
                    warn_user(f"artnb: PipelineTrainer could not refresh {type(plot).__name__}: {error}")
            if owner.eval_fn is not None and result.step % owner.eval_every_n_steps == 0:
                self.evals.append(asyncio.ensure_future(self._evaluate(owner.eval_fn, result.step)))
            if owner.checkpoint_retention_strategy and result.step % owner.checkpoint_retention_interval == 0:
                await self._retain_checkpoints(owner.checkpoint_retention_strategy, result.step)

    async def _retain_checkpoints(self, strategy: CheckpointRetentionStrategy, step: int) -> None:
        """Apply the retention strategy, offering no checkpoint that a rollout still queued or running may have
        been sampled from, nor one being evaluated; a failure is warned about, training goes on."""
        window = self._start_bound()
        oldest_in_use = min([f.version for f in self.ready] + [step - (window or 0)])
        protected = set(range(max(0, oldest_in_use), step + 1)) | self.evaluating
        if window is None:
            protected |= set(range(0, step + 1))  # unbounded lag: any step may still be in use
        try:
            await self.owner.backend._retain_checkpoints(self.model, strategy, step, protected)
        except Exception as error:
            warn_user(f"artnb: PipelineTrainer: checkpoint retention at step {step} failed ({error})")

    async def _take_batch(self) -> list[_Finished] | None:
        """The next batch (None: nothing more will come; []: every group taken was stale)."""
        owner = self.owner
        async with self.cond:
            while True:
                if self.fatal is not None:
                    raise self.fatal
                if owner._stop_requested:
                    return None
                if len(self.ready) >= owner.min_batch_size:
                    break
                if self.exhausted and self.in_flight == 0:
                    if not self.ready:
                        return None
                    break  # the last groups: a smaller batch
                await self.cond.wait()
            self.ready.sort(key=lambda f: (f.version, f.index))  # the stalest first, before they go stale
            batch, self.ready = self.ready[: owner.max_batch_size], self.ready[owner.max_batch_size :]
            stale = [f for f in batch if self._too_stale(f)]
            for f in stale:
                self._finish(f.index)
            self.stale_this_step += len(stale)
            self.summary.stale_groups_discarded += len(stale)
            batch = [f for f in batch if f not in stale]
            self.training = bool(batch)
            self.cond.notify_all()
            return batch

    def _take_actor_idle(self) -> float:
        now = time.monotonic()
        idle = self.actor_idle_s + (now - self.idle_since if self.in_flight == 0 else 0.0)
        self.actor_idle_s, self.idle_since = 0.0, now
        return idle

    def _show(self, metrics: dict[str, Any]) -> None:
        self.bar.update()
        shown = {
            "step": self.summary.final_step,
            "reward": metrics.get("train/reward"),
            "lag": metrics.get(names.trainer("steps_off_policy")),
            "ready": len(self.ready),
            "running": self.in_flight,
            "stale": self.summary.stale_groups_discarded,
        }
        self.bar.set_postfix(
            {k: f"{v:.3g}" if isinstance(v, float) else v for k, v in shown.items() if v is not None}
        )

    # evaluation ------------------------------------------------------------------------------------------
    async def _evaluate(self, eval_fn: EvalFn, step: int) -> None:
        owner = self.owner
        started = time.monotonic()
        self.evaluating.add(step)
        try:
            with self.model.activate_metrics_context("eval"):
                out = await eval_fn(self.model, step, owner.config)
            splits = out if isinstance(out, dict) else {"val": out}
            for split, items in splits.items():
                await self.model.log(
                    items, split=split, step=step, metrics={"time/step_eval_s": time.monotonic() - started}
                )
        except asyncio.CancelledError:
            raise
        except Exception as error:  # as in ART: an evaluation failure is reported, training goes on
            warn_user(
                f"artnb: PipelineTrainer: evaluation at step {step} failed ({type(error).__name__}: {error})"
            )
        finally:
            self.evaluating.discard(step)


def _retention_on(
    backend: Any, strategy: CheckpointRetentionStrategy | None
) -> CheckpointRetentionStrategy | None:
    """`strategy` if `backend` can delete checkpoints for it (LocalBackend); else None, reported."""
    if strategy is None or hasattr(backend, "_retain_checkpoints"):
        return strategy
    report_ignored(
        "PipelineTrainer(checkpoint_retention_strategy=...)",
        f"{type(backend).__name__} cannot delete chosen checkpoints; `await model.delete_checkpoints()` keeps the "
        "latest and the best",
    )
    return None


def _report_ignored_keywords(save_checkpoint: bool, kl_penalty_step_lag: int | None, executor: Any) -> None:
    """ART's PipelineTrainer keywords that change nothing here, each reported once when it asks for something."""
    if not save_checkpoint:
        report_ignored("PipelineTrainer(save_checkpoint=False)", "every step is a checkpoint (a commit)")
    if kl_penalty_step_lag is not None:
        report_ignored(
            "PipelineTrainer(kl_penalty_step_lag=...)",
            "the KL reference is always the base model (the adapter switched off), never an earlier step",
        )
    if executor is not None:
        report_ignored(
            "PipelineTrainer(rollout_executor=...)",
            "rollouts run as asyncio tasks in this process, num_rollout_workers of them at once",
        )


def _no_trajectories(group: TrajectoryGroup) -> Exception:
    if group.exceptions:
        first = group.exceptions[0]
        return RuntimeError(f"every rollout of the group failed; the first: {first.type}: {first.message}")
    return RuntimeError("rollout_fn returned an empty group")


async def _scenario_iterator(scenarios: Iterable[Any] | AsyncIterator[Any]) -> AsyncIterator[Any]:
    if hasattr(scenarios, "__aiter__"):
        async for scenario in scenarios:  # type: ignore[union-attr]
            yield scenario
        return
    iterator: Iterator[Any] = iter(scenarios)  # type: ignore[arg-type]
    for scenario in iterator:
        yield scenario


def _install_signal_handlers(loop: asyncio.AbstractEventLoop, stop: Callable[[], None]) -> list[int]:
    """SIGINT/SIGTERM -> a graceful stop, in a script's main thread only (a notebook kernel keeps its interrupt)."""
    if "ipykernel" in sys.modules or threading.current_thread() is not threading.main_thread():
        return []
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop)
        except (NotImplementedError, RuntimeError, ValueError):  # e.g. Windows' event loops
            continue
        installed.append(sig)
    return installed


__all__ = [
    "CheckpointInfo",
    "CheckpointRetentionContext",
    "CheckpointRetentionStrategy",
    "PipelineAutotuneConfig",
    "PipelineRuntimeConfig",
    "PipelineSummary",
    "PipelineTrainer",
    "keep_recent_and_top",
    "make_group_rollout_fn",
]
