"""What one training step takes and what it gives back, built and read in core so that backends only run steps.

Why: `TrainableModel.train` (and ART's `backend.train`, which calls it) resolves the config, ART's keywords and
the batch's type once, into a `TrainRequest`; a backend (local, remote, or the server behind a remote one) runs
it and returns a `TrainOutcome`: the result and, when the step committed, what it committed. The model records
the outcome itself (ART's `model.log(groups, split="train")` merges into that record), so data flows one way and
no backend writes into a model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, Field, PlainValidator

from .config import TrainConfig, resolve_train_config
from .gather import AfterEachFailure, GatheredGroups
from .trajectory import Trajectory, TrajectoryGroup, check_metadata

if TYPE_CHECKING:
    from .sft import TrainSFTConfig  # sft.py imports transformers: not at `import artnb`


class TrainResult(BaseModel):
    """What `model.train(...)` and `model.train_sft(...)` return (ART's LocalTrainResult)."""

    step: int  # the new step (its checkpoint is being served)
    metrics: dict[str, Any] = Field(default_factory=dict)
    checkpoint_path: str | None = None
    skipped: str | None = None  # why the step made no update (equal rewards, nothing to train on), if so
    # ART's signal for a checkpoint still being written when train() returns (None: checkpoint_path is usable).
    # A step here returns after its commit, so it is always None; ART code that awaits it when set works as is.
    checkpoint_ready: Annotated[Awaitable[None] | None, PlainValidator(lambda v: v)] = Field(
        default=None, exclude=True, repr=False
    )


@dataclass(frozen=True)
class TrainRequest:
    """One GRPO step's batch and its resolved config."""

    groups: list[TrajectoryGroup]
    config: TrainConfig
    after_each_failures: list[AfterEachFailure] | None = (
        None  # from gather_trajectory_groups, when it gathered
    )

    @classmethod
    def build(
        cls,
        trajectory_groups: Iterable[TrajectoryGroup],
        config: TrainConfig | None,
        options: Mapping[str, Any],
    ) -> TrainRequest:
        """`config`, ART's `_config` dict and keyword `options` resolved (see resolve_train_config); TypeError
        for a batch that is not a list of TrajectoryGroup."""
        options = dict(options)
        resolved = resolve_train_config(config, options, options.pop("_config", None))
        failures = getattr(trajectory_groups, "after_each_failures", None)
        groups = list(trajectory_groups)
        if not all(isinstance(g, TrajectoryGroup) for g in groups):
            raise TypeError(
                "train() takes a list of art.TrajectoryGroup; await gather_trajectory_groups(...) first"
            )
        for gi, group in enumerate(groups):
            check_metadata(group.trajectories, then="Nothing was trained", group=gi)
        return cls(groups, resolved, None if failures is None else list(failures))

    def batch(self) -> list[TrajectoryGroup]:
        """The groups as the gather returned them (a GatheredGroups when it recorded failures), for the wire."""
        if self.after_each_failures is None:
            return self.groups
        return GatheredGroups(self.groups, self.after_each_failures)


@dataclass(frozen=True)
class SFTRequest:
    """One SFT step's trajectories and its resolved config."""

    trajectories: list[Trajectory]
    config: TrainSFTConfig

    @classmethod
    def build(
        cls, trajectories: Iterable[Trajectory], config: TrainSFTConfig | None, options: Mapping[str, Any]
    ) -> SFTRequest:
        from .sft import merge_sft_config

        options = dict(options)
        resolved = merge_sft_config(config, options, options.pop("_config", None))
        items = list(trajectories)
        wrong = next((t for t in items if not isinstance(t, Trajectory)), None)
        if wrong is not None:
            raise TypeError(
                f"train_sft() takes art.Trajectory objects, got {type(wrong).__name__}; wrap chat examples as "
                "art.Trajectory(messages_and_choices=[...]) or read a JSONL file with "
                "artnb.utils.sft.train_sft_from_file"
            )
        check_metadata(items, then="Nothing was trained")
        return cls(items, resolved)


@dataclass(frozen=True)
class Committed:
    """What a committed step wrote: the policy step its rollouts came from, the new step, the commit id and
    the step's history row."""

    steps: tuple[int, int]
    commit: str
    row: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainOutcome:
    """A step's result, and what it committed (None when it committed nothing, e.g. a retried batch)."""

    result: TrainResult
    committed: Committed | None = None


class CommittedWhileCancelled(asyncio.CancelledError):
    """The caller was cancelled (a cell interrupt) after the step's trainer had started, so the step committed
    first: still a cancellation to asyncio, carrying what the step produced for the model to record."""

    def __init__(self, outcome: TrainOutcome) -> None:
        super().__init__(f"cancelled after step {outcome.result.step} was committed")
        self.outcome = outcome
