"""Where artnb tells observability tools about a run: W&B and Trackio runs, Langfuse traces.

Each integration is a `Reporter` (core/reporting.py), chosen once per model by its `reporter_for(model)` (None
when it is not asked for: no import, no network). Importing this package registers them with core's registry
(`import artnb` does), and the model reports to them itself through `model.reporting`: each history row it
records and each OpenAI client it makes; the backends close them and the widgets link to them there too. The
helpers below are what the reporters share. A reporter that fails warns once and is never allowed to stop
training.
"""

from __future__ import annotations

import importlib
import math
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..core import reporting
from ..core.reporting import Reporter

if TYPE_CHECKING:
    from ..core.model import Model
    from ..core.trajectory import Trajectory, TrajectoryGroup

# module:function giving each integration's reporter for a model, or None
FACTORIES = (
    "artnb.integrations.wandb_run:reporter_for",
    "artnb.integrations.trackio_run:reporter_for",
    "artnb.integrations.langfuse_traces:reporter_for",
)


def _imported_on_use(spec: str) -> reporting.ReporterFactory:
    """The factory `spec` names, its module imported only when a model first asks for reporters."""

    def factory(model: Model) -> Reporter | None:
        module, function = spec.split(":")
        return getattr(importlib.import_module(module), function)(model)

    return factory


WANDB, TRACKIO, LANGFUSE = FACTORIES
reporting.register(WANDB, _imported_on_use(WANDB), metric_name="wandb")
reporting.register(TRACKIO, _imported_on_use(TRACKIO), metric_name="trackio")
reporting.register(LANGFUSE, _imported_on_use(LANGFUSE), chosen_by="Langfuse, by its keys")

_NOT_METRICS = {"step", "split", "recorded_at", "commit"}


def numeric_metrics(row: dict[str, Any]) -> dict[str, float]:
    """The values of a history row a tracker plots: finite numbers, without the row's step/split/commit fields."""
    return {
        k: float(v)
        for k, v in row.items()
        if k not in _NOT_METRICS and isinstance(v, (int, float)) and math.isfinite(v)
    }


def sample_trajectories(
    step: int, groups: Sequence[TrajectoryGroup], limit: int
) -> list[tuple[int, int, Trajectory]]:
    """(group index, index in group, trajectory) of up to `limit` trajectories, sampled with the step as seed
    (a rerun of the step picks the same ones)."""
    items = [(g, i, t) for g, group in enumerate(groups) for i, t in enumerate(group.trajectories)]
    if len(items) > limit:
        items = sorted(random.Random(step).sample(items, limit), key=lambda x: (x[0], x[1]))
    return items


def __getattr__(name: str) -> Any:
    """`art.integrations.enable_langfuse(...)`, `art.integrations.init_weave(...)`: imported on first use."""
    if name == "enable_langfuse":
        from .langfuse_traces import enable_langfuse

        return enable_langfuse
    if name == "init_weave":
        from .weave_init import init_weave

        return init_weave
    raise AttributeError(f"module 'artnb.integrations' has no attribute {name!r}")
