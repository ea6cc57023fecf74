"""TrainingLoop: the gather → score → train loop as separate phases that can be run one at a time and stopped.

`TrainingPanel` is a view over this class; it holds every decision, so it is tested without widgets:
- Each phase is an `async` method; nothing blocks the event loop (rollouts are HTTP calls, training runs on
  the backend's trainer thread), so a notebook kernel stays responsive while a step runs.
- Gathered groups wait in `pending` until trained. Stop is honoured between phases, never inside one, so a
  stopped run loses nothing: pending groups stay for the next Train step, and trained rollouts are on disk
  (`backend.train` commits them with the step's checkpoint).
- Progress is reported as events to listeners (`loop.on(fn)`): phase changes, rollouts finished, scoring
  progress, seconds spent training against the previous step's duration, groups gathered, steps trained.
  A listener that raises is warned about once and never stops the loop: a display bug must not hide the
  loop's own error (e.g. a rollout's non-finite reward) behind its own.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from . import metric_names as names
from .config import TrainConfig
from .gather import gather_trajectory_groups
from .ignored import warn_user
from .model import TrainableModel, TrainResult
from .trajectory import Trajectory, TrajectoryGroup

Phase = Literal["idle", "gather", "score", "train"]
Rollout = Callable[[TrainableModel, Any], Awaitable[Trajectory]]
Scorer = Callable[[TrajectoryGroup], Awaitable[TrajectoryGroup | None]]
Scenarios = Callable[[int], Iterable[Any]] | Iterable[Any]


@dataclass
class LoopEvent:
    kind: Literal["phase", "progress", "groups", "trained", "stopped"]
    phase: Phase
    done: float = 0.0  # progress: rollouts or groups finished, or seconds trained
    total: float | None = None  # progress: out of how many (train: the previous step's seconds, if known)
    groups: list[TrajectoryGroup] = field(default_factory=list)
    result: TrainResult | None = None


class LoopBusy(RuntimeError):
    """A phase is already running; wait for it (or press Stop) before starting another."""


class TrainingLoop:
    """Gather groups of rollouts, optionally score them, train a step; one phase at a time.

    Example:
        loop = TrainingLoop(model, tic_tac_toe.rollout, scenarios=lambda step: [step], group_size=8)
        await loop.run(3)             # three steps of gather → (score) → train
        loop.stop()                   # from elsewhere: finish the current phase, then stop

    rollout: `async rollout(model, scenario) -> Trajectory`.
    scenarios: `scenarios(step)` giving the step's scenarios (one group each), or a fixed list used every step.
    score: `async score(group) -> group` run on every gathered group (e.g. RULER); None: rewards as returned.
    """

    def __init__(
        self,
        model: TrainableModel,
        rollout: Rollout,
        scenarios: Scenarios,
        *,
        group_size: int = 8,
        score: Scorer | None = None,
        train_config: TrainConfig | None = None,
        max_exceptions: int | float = 0,
    ) -> None:
        if group_size < 2:
            raise ValueError(f"group_size={group_size}; GRPO compares rollouts within a group, so use >= 2")
        self.model = model
        self.rollout = rollout
        self.scenarios = scenarios if callable(scenarios) else list(scenarios)
        self.group_size = group_size
        self.scorer = score
        self.train_config = train_config
        self.max_exceptions = max_exceptions
        self.phase: Phase = "idle"
        self.pending: list[TrajectoryGroup] = []  # gathered, not trained yet
        self.pending_scored = False
        self.last_groups: list[TrajectoryGroup] = []  # the latest gathered, kept after training
        self.last_result: TrainResult | None = None
        self.stop_requested = False
        self._busy = False
        self._listeners: list[Callable[[LoopEvent], None]] = []
        self._failed_listeners: set[int] = set()  # ids of listeners already warned about (they stay listed)

    # events -------------------------------------------------------------------------------------------
    def on(self, listener: Callable[[LoopEvent], None]) -> None:
        """Call `listener(event)` for every event; a listener must be quick (it runs on the event loop)."""
        self._listeners.append(listener)

    def _emit(self, event: LoopEvent) -> None:
        for listener in self._listeners:
            try:
                listener(event)
            except Exception as error:  # a display bug must not abort a gather or hide the real error
                if id(listener) not in self._failed_listeners:
                    self._failed_listeners.add(id(listener))
                    name = getattr(listener, "__qualname__", repr(listener))
                    warn_user(
                        f"artnb: TrainingLoop listener {name} raised {type(error).__name__}: {error}; "
                        "the loop goes on (this warning is shown once per listener)"
                    )

    def _set_phase(self, phase: Phase) -> None:
        self.phase = phase
        self._emit(LoopEvent("phase", phase))

    @property
    def busy(self) -> bool:
        return self._busy

    def stop(self) -> None:
        """Stop after the current phase; a no-op when idle."""
        if self._busy:
            self.stop_requested = True

    # state --------------------------------------------------------------------------------------------
    def scenarios_for(self, step: int) -> list[Any]:
        items = list(self.scenarios(step)) if callable(self.scenarios) else self.scenarios
        if not items:
            raise ValueError(
                f"no scenarios for step {step}; `scenarios` must give at least one (one group each)"
            )
        return items

    def train_estimate_s(self) -> float | None:
        """Seconds the previous training step took, from the history; None before the first step."""
        history = self.model.history()
        col = names.STEP_TRAIN_S
        if col not in history:
            return None
        values = history[col].dropna()
        return float(values.iloc[-1]) if len(values) else None

    async def engine_state(self, timeout: float = 3.0) -> str:
        """A short line on the inference engine: serving which step, held for training, or not answering."""
        if not self.model.inference_base_url:
            return "not registered: `await model.register(backend)` first"
        if self.phase == "train":
            return "held while training (requests wait)"
        try:
            step = await self.model.get_step()
            await asyncio.wait_for(self.model.openai_client().models.list(), timeout)
        except Exception as exc:  # any failure to answer is the state we report
            return f"not answering ({type(exc).__name__}); the next request restarts it"
        return f"serving {self.model.get_inference_name()} at step {step}"

    # phases -------------------------------------------------------------------------------------------
    async def gather(self) -> list[TrajectoryGroup]:
        """Run one group of rollouts per scenario of the current step; they wait in `pending` for training."""
        async with self._operation():
            return await self._gather()

    async def score(self) -> list[TrajectoryGroup]:
        """Score the pending groups with `score` (replacing them with what it returns)."""
        async with self._operation():
            return await self._score()

    async def train(self) -> TrainResult:
        """Train one step on the pending groups."""
        async with self._operation():
            return await self._train()

    async def step(self) -> TrainResult | None:
        """Gather (unless groups are pending), score (if a scorer is set), train. None if stopped before training."""
        async with self._operation():
            return await self._step()

    async def run(self, steps: int) -> list[TrainResult]:
        """`steps` steps, stopping early (after the current phase) when `stop()` is called."""
        results = []
        async with self._operation():
            for _ in range(steps):
                result = await self._step()
                if result is None:
                    break
                results.append(result)
                if self.stop_requested:
                    break
        return results

    # internals ----------------------------------------------------------------------------------------
    @asynccontextmanager
    async def _operation(self) -> AsyncIterator[None]:
        """One user action (a phase, a step, a run): exclusive, and back to idle however it ends."""
        if self._busy:
            raise LoopBusy(f"the loop is busy ({self.phase}); wait for it to finish or call stop()")
        self._busy = True
        self.stop_requested = False
        try:
            yield
        finally:
            stopped = self.stop_requested
            self._busy = False
            self.stop_requested = False
            self._set_phase("idle")
            if stopped:
                self._emit(LoopEvent("stopped", "idle"))

    async def _step(self) -> TrainResult | None:
        if not self.pending:
            await self._gather()
            if self.stop_requested:
                return None
        if self.scorer is not None and not self.pending_scored:
            await self._score()
            if self.stop_requested:
                return None
        return await self._train()

    async def _gather(self) -> list[TrajectoryGroup]:
        step = await self.model.get_step()
        scenarios = self.scenarios_for(step)
        total = len(scenarios) * self.group_size
        done = 0
        self._set_phase("gather")
        self._emit(LoopEvent("progress", "gather", 0, total))

        async def counted(scenario: Any) -> Trajectory:
            nonlocal done
            try:
                return await self.rollout(self.model, scenario)
            finally:
                done += 1
                self._emit(LoopEvent("progress", "gather", done, total))

        groups = await gather_trajectory_groups(
            (
                TrajectoryGroup((counted(s) for _ in range(self.group_size)), metadata={"scenario": s})
                for s in scenarios
            ),
            pbar_desc=f"gather step {step}",
            max_exceptions=self.max_exceptions,
        )
        self.pending = groups
        self.pending_scored = False
        self.last_groups = groups
        self._emit(LoopEvent("groups", "gather", groups=groups))
        return groups

    async def _score(self) -> list[TrajectoryGroup]:
        if self.scorer is None:
            raise ValueError(
                "no scorer: pass score=... (e.g. a RULER judge: lambda g: art.ruler_score_group(g, judge))"
            )
        if not self.pending:
            raise ValueError("nothing to score: gather first")
        self._set_phase("score")
        total = len(self.pending)
        self._emit(LoopEvent("progress", "score", 0, total))
        scored: list[TrajectoryGroup] = []
        for i, group in enumerate(self.pending):
            out = self.scorer(group)
            out = await out if inspect.isawaitable(out) else out
            if out is not None:
                if not isinstance(out, TrajectoryGroup):
                    raise TypeError(
                        f"score returned {type(out).__name__}; it must return a TrajectoryGroup or None"
                    )
                scored.append(out)
            self._emit(LoopEvent("progress", "score", i + 1, total))
        self.pending = scored
        self.pending_scored = True
        self.last_groups = scored
        self._emit(LoopEvent("groups", "score", groups=scored))
        return scored

    async def _train(self) -> TrainResult:
        if not self.pending:
            raise ValueError("nothing to train on: gather first (Train step gathers by itself)")
        estimate = self.train_estimate_s()
        self._set_phase("train")
        started = time.monotonic()
        task = asyncio.ensure_future(self.model.train(self.pending, config=self.train_config))
        while not task.done():
            self._emit(LoopEvent("progress", "train", time.monotonic() - started, estimate))
            await asyncio.wait([task], timeout=0.5)
        result = task.result()
        self.pending = []
        self.pending_scored = False
        self.last_result = result
        elapsed = time.monotonic() - started
        self._emit(LoopEvent("progress", "train", elapsed, elapsed))
        self._emit(LoopEvent("trained", "train", groups=self.last_groups, result=result))
        return result
