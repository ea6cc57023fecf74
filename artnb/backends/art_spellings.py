"""ART's `backend.train(model, groups)` and `backend.train_sft(model, trajectories)`, for every backend.

Why: in artnb the model is the one entry point of a step (`model.train` builds the request and records the
outcome; core/train_request.py), so ART's backend-first spellings are that call and nothing else, written once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..core.config import TrainConfig
from ..core.model import TrainableModel, TrainResult
from ..core.sft import TrainSFTConfig
from ..core.trajectory import Trajectory, TrajectoryGroup


class ArtTrainSpellings:
    async def train(
        self,
        model: TrainableModel,
        trajectory_groups: Iterable[TrajectoryGroup],
        *,
        config: TrainConfig | None = None,
        **options: Any,
    ) -> TrainResult:
        """`model.train(trajectory_groups, config, **options)`: one GRPO step. Keywords override `config` fields,
        e.g. `backend.train(model, groups, learning_rate=1e-4)`; `_config` takes them as ART's `dev.TrainConfig`
        dict."""
        return await model.train(trajectory_groups, config, **options)

    async def train_sft(
        self,
        model: TrainableModel,
        trajectories: Iterable[Trajectory],
        config: TrainSFTConfig | None = None,
        **options: Any,
    ) -> TrainResult:
        """`model.train_sft(trajectories, config, **options)`: one SFT step. Keywords override `config` fields,
        e.g. `backend.train_sft(model, trajectories, learning_rate=1e-4, batch_size=4)`."""
        return await model.train_sft(trajectories, config, **options)
