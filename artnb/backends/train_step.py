"""One training step of LocalBackend as a transaction, written top to bottom as its phases.

    validate → tokenise → hold → train → commit (→ rename) → publish → hot-load → release

Until the commit nothing on disk changes. The commit (`RunStore.commit_step`) writes checkpoint step+1 with the
step's history row and rollouts inside it and renames it into place: after that rename the step happened, and
what follows (publishing the row and rollouts, loading the adapter into the engine, releasing held requests)
cannot undo it; a failure there is a warning, and the work is finished later (`RunStore.publish_pending`, the
engine transport). A failure before the commit reloads the trainer from the last checkpoint, so the weights and
optimizer in memory are never ahead of the disk.

Cancellation (a cell interrupt, `asyncio.wait_for`): the step runs in a task of its own. Cancelled before the
trainer starts, the step stops there; after, the caller waits for the commit and then sees the cancellation.

Each phase is logged at DEBUG on the "artnb" logger with `record.artnb_phase` (the reliability tests kill a
training process at each one). Warnings are collected and shown in the caller's frame when `run` returns.
"""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from typing import TYPE_CHECKING, Any

from ..core.config import TrainConfig
from ..core.model import NothingToTrainError, TrainResult, summarize_groups
from ..core.tokenize import TokenizedBatch, tokenize_groups
from ..core.trajectory import TrajectoryGroup

if TYPE_CHECKING:
    from .local import LocalBackend, _Served

log = logging.getLogger("artnb")

PHASES = ("validate", "tokenise", "hold", "train", "commit", "rename", "publish", "hot-load", "release")


class TrainStep:
    """One `backend.train(model, groups)` call: its phases, and whether it can still be abandoned."""

    def __init__(
        self,
        backend: LocalBackend,
        served: _Served,
        groups: list[TrajectoryGroup],
        config: TrainConfig,
        extra_row: dict[str, Any] | None = None,
    ) -> None:
        self.backend, self.served, self.groups, self.config = backend, served, groups, config
        self.extra_row = dict(extra_row or {})  # more values for the step's history row
        self.step = served.step
        self.phase = "queued"
        self.irreversible = False  # past "train": the step commits even if the caller is cancelled
        self.notes: list[str] = []
        self.started = 0.0

    async def run(self) -> TrainResult:
        """Run the step in its own task; see the module docstring for what cancelling the caller does."""
        task = asyncio.ensure_future(self._phases())
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not self.irreversible:
                task.cancel()  # nothing trained yet: stop here, releasing the engine if it was held
                await asyncio.wait([task])
                raise
            await _wait_through_cancellation(task)  # the trainer is running: let the step commit first
            raise
        finally:
            for note in self.notes:
                warnings.warn(note, stacklevel=4)  # run <- backend.train <- model.train <- the user's cell

    async def _phases(self) -> TrainResult:
        served = self.served
        async with served.step_lock:  # one step at a time per model
            self.started = time.monotonic()
            self.step = served.step
            await asyncio.to_thread(served.store.publish_pending)  # what an earlier step could not publish
            self._enter("validate")
            if reason := _empty_reason(self.groups):
                return await self._nothing_to_train(reason)
            batch = await self._tokenise()
            if not batch.sequences and batch.metrics["num_dropped_too_long"]:
                return await self._nothing_to_train(batch.skipped_reason)
            metrics: dict[str, Any] = {f"data/{k}": v for k, v in batch.metrics.items()}
            if not batch.sequences:
                return await self._advance_without_update(metrics, batch.skipped_reason)
            try:
                await self._hold()
                self._enter("train")
                try:
                    trained = await self.backend._on_trainer_thread(
                        served.trainer.train, batch.sequences, self.config
                    )
                    metrics.update({f"train/{k}": v for k, v in trained.items()})
                    result = await self._commit(metrics, served.trainer.save_checkpoint)
                except BaseException:
                    await self._restore_trainer()
                    raise
                await self._publish_and_hot_load()
            finally:
                await self._release()
            return result

    # phases ---------------------------------------------------------------------------------------------
    def _enter(self, phase: str) -> None:
        self.phase = phase
        self.irreversible = self.irreversible or phase == "train"
        store = self.served.store
        log.debug(
            "%s/%s step %d: %s", store.project, store.name, self.step, phase, extra={"artnb_phase": phase}
        )

    async def _tokenise(self) -> TokenizedBatch:
        self._enter("tokenise")
        config, served = self.config, self.served
        return await asyncio.to_thread(
            tokenize_groups,
            served.tokenizer,
            self.groups,
            scale_rewards=config.scale_rewards,
            allow_training_without_logprobs=config.allow_training_without_logprobs,
            max_seq_length=config.max_seq_length or served.trainer.max_seq_length,
        )

    async def _nothing_to_train(self, reason: str) -> TrainResult:
        """No data to learn from: an error, or (if asked) a skipped step in the history without a checkpoint."""
        store, step = self.served.store, self.step
        if self.config.on_nothing_to_train == "raise":
            raise NothingToTrainError(
                f"nothing to train on at step {step}: {reason}. The step did not advance and nothing was "
                "written. Gather again, or pass on_nothing_to_train='skip' to record a skipped step instead"
            )
        metrics = {"train/skipped": 1}
        await asyncio.to_thread(store.append_history, self._history_row(metrics))
        return TrainResult(
            step=step, metrics=metrics, checkpoint_path=str(store.checkpoint_path(step)), skipped=reason
        )

    async def _advance_without_update(self, metrics: dict[str, Any], reason: str) -> TrainResult:
        """Equal rewards in every group: a real, measured step with no gradient. It commits a copy of the
        checkpoint with the rollouts, so step-driven loops (and datasets resumed by step) move on, as in ART."""
        self.notes.append(
            f"artnb: step {self.step} had nothing to train on: {reason}. The step still advances (checkpoint "
            f"{self.step + 1:04d} = {self.step:04d}) and its rollouts are recorded."
        )
        metrics["train/skipped"] = 1
        result = await self._commit(metrics, None)
        await self._publish_and_hot_load()
        return result.model_copy(update={"skipped": reason})

    async def _hold(self) -> None:
        self._enter("hold")
        await self.backend.ensure_engine(self.served.model)
        await self.served.engine.hold()

    async def _commit(self, metrics: dict[str, Any], write: Any) -> TrainResult:
        """Checkpoint step+1 (written by `write`, or a copy when None) with the history row and the rollouts in
        it, in one rename: the commit point."""
        served, step = self.served, self.step
        self._enter("commit")
        metrics["time/step_train_s"] = time.monotonic() - self.started
        row = self._history_row(metrics)
        await self.backend._on_trainer_thread(served.store.commit_step, step, write, row, self.groups)
        served.step = step + 1
        return TrainResult(
            step=step + 1, metrics=metrics, checkpoint_path=str(served.store.checkpoint_path(step + 1))
        )

    async def _publish_and_hot_load(self) -> None:
        """After the commit: failures here are warnings, and the work is redone later (never undone)."""
        served = self.served
        self._enter("publish")
        try:
            await asyncio.to_thread(served.store.publish, served.step)
        except Exception as error:
            self.notes.append(
                f"artnb: step {self.step} is committed, but writing its history row and rollouts failed "
                f"({error}); they are kept in checkpoint {served.step:04d} and written at the next step or "
                "register"
            )
        self._enter("hot-load")
        try:
            await self.backend.ensure_engine(served.model)
        except Exception as error:
            self.notes.append(
                f"artnb: step {served.step} is committed, but the engine could not load it ({error}); the "
                "next request loads it"
            )

    async def _restore_trainer(self) -> None:
        """Put the trainer back to the last committed checkpoint after the step failed before its commit."""
        served = self.served
        await self.backend._on_trainer_thread(
            served.trainer.load_checkpoint, served.store.checkpoint_path(served.step)
        )

    async def _release(self) -> None:
        served = self.served
        self._enter("release")
        if not served.engine.alive():
            return  # a dead engine holds nothing; the next request restarts it
        try:
            await served.engine.release()
        except Exception as error:
            self.notes.append(
                f"artnb: could not release the inference engine after step {self.step} ({error}); it is "
                "stopped so that no request waits forever, and the next request restarts it"
            )
            await served.engine.stop()

    def _history_row(self, metrics: dict[str, Any]) -> dict[str, Any]:
        summary = {f"train/{k}": v for k, v in summarize_groups(self.groups).items()}
        return {"step": self.step, "split": "train", **summary, **self.extra_row, **metrics}


def _empty_reason(groups: list[TrajectoryGroup]) -> str | None:
    if not groups:
        return "the batch is empty (no groups: were they all dropped by after_each / RULER?)"
    if not any(g.trajectories for g in groups):
        return "no group of the batch has a trajectory (did every rollout fail?)"
    return None


async def _wait_through_cancellation(task: asyncio.Future) -> None:
    """Wait until `task` is done, even if this coroutine is cancelled again meanwhile."""
    while not task.done():
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError:
            continue
