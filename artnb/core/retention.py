"""Which checkpoints a long PipelineTrainer run keeps: ART 0.5.23's `checkpoint_retention_strategy`.

A strategy is a function from a `CheckpointRetentionContext` (the step just trained, and the checkpoints that may
go) to the steps of those to keep; the rest are deleted. The newest checkpoint and those that rollouts still in
flight may have been sampled from are never offered, so a strategy cannot delete what the run still uses.
`keep_recent_and_top` is the usual one: the last few, and the best few by a metric of the run's history.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime

from pydantic import BaseModel, Field

from . import metric_names as names


class CheckpointInfo(BaseModel):
    """One checkpoint a strategy may delete: its step, directory, when it was written, and the run history's
    means at that step (e.g. `val/reward` when the run was evaluated there)."""

    step: int
    path: str
    created_at: datetime
    is_eval_step: bool = False
    metrics: dict[str, float] = Field(default_factory=dict)


class CheckpointRetentionContext(BaseModel):
    """What a strategy decides on: the current step and the checkpoints it may delete."""

    current_step: int
    checkpoints: list[CheckpointInfo] = Field(default_factory=list)


CheckpointRetentionStrategy = Callable[[CheckpointRetentionContext], Iterable[int]]


def keep_recent_and_top(
    *, recent: int = 5, top: int = 2, metric: str = names.BEST_CHECKPOINT_METRIC
) -> CheckpointRetentionStrategy:
    """A strategy that keeps the `recent` newest checkpoints offered and the `top` best by `metric` (higher is
    better; artnb's name, e.g. "val/reward"). Checkpoints without the metric are never among the best."""
    if recent < 0 or top < 0:
        raise ValueError(f"keep_recent_and_top(recent={recent}, top={top}): both are counts, >= 0")

    def strategy(context: CheckpointRetentionContext) -> set[int]:
        by_step = sorted(context.checkpoints, key=lambda c: c.step)
        keep = {c.step for c in by_step[-recent:]} if recent else set()
        scored = [c for c in by_step if metric in c.metrics]
        scored.sort(key=lambda c: (c.metrics[metric], c.step), reverse=True)
        return keep | {c.step for c in scored[:top]}

    strategy.metric = metric  # type: ignore[attr-defined]  # checked against the history before anything goes
    return strategy
