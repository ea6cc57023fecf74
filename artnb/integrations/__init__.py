"""Where artnb tells observability tools about a run: W&B and Trackio runs, Langfuse traces.

Two calls, made by the core and the backends, are the whole seam:
- `report(model, row, groups, config)` after each history row is recorded (a train step's row, `model.log` rows
  and the metrics merged into a trained step), with the groups behind it and, for a training step, its config;
- `instrument(model, client)` on each OpenAI client `model.openai_client()` makes, so a tracer can see every
  chat completion.
Each integration is a `Reporter`, chosen once per model by its `reporter_for(model)` (None when it is not asked
for: no import, no network). A reporter that fails warns once and is never allowed to stop training.
"""

from __future__ import annotations

import importlib
import math
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel

from ..core.ignored import warn_user

if TYPE_CHECKING:
    from ..core.model import Model
    from ..core.trajectory import Trajectory, TrajectoryGroup

# module:function giving each integration's reporter for a model, or None
FACTORIES = (
    "artnb.integrations.wandb_run:reporter_for",
    "artnb.integrations.trackio_run:reporter_for",
    "artnb.integrations.langfuse_traces:reporter_for",
)
METRIC_REPORTERS = ("wandb", "trackio")  # what `report_metrics=[...]` may name


class Reporter(Protocol):
    name: str  # e.g. "W&B", in messages
    url: str | None  # where a person sees what it recorded (the W&B run, the Langfuse project), once known

    def log_row(
        self, model: Model, row: dict[str, Any], groups: Sequence[TrajectoryGroup], config: BaseModel | None
    ) -> None:
        """A history row was recorded (`row["split"]`, `row["step"]`, metrics), with its groups (maybe none) and,
        for a training step, the TrainConfig or TrainSFTConfig it ran with."""

    def instrument(self, model: Model, client: Any) -> None:
        """`client` (an AsyncOpenAI) was made for `model`: hook its requests if this reporter traces them."""

    def close(self) -> None: ...


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


def reporters(model: Model) -> list[Reporter]:
    """The model's reporters, chosen on first use and kept on the model."""
    found = getattr(model, "_reporters", None)
    if found is None:
        found = []
        for spec in FACTORIES:
            module, function = spec.split(":")
            try:
                reporter = getattr(importlib.import_module(module), function)(model)
            except Exception as error:  # a broken integration must not stop training
                _warn_once(model, spec, f"could not start ({type(error).__name__}: {error})")
                continue
            if reporter is not None:
                found.append(reporter)
        model._reporters = found
    return found


def report(
    model: Model,
    row: dict[str, Any],
    groups: Sequence[TrajectoryGroup] = (),
    config: BaseModel | None = None,
) -> None:
    """Give a recorded history row to every reporter of `model`; failures warn once per reporter."""
    for reporter in reporters(model):
        try:
            reporter.log_row(model, row, groups, config)
        except Exception as error:
            _warn_once(
                model,
                reporter.name,
                f"failed to record step {row.get('step')} ({type(error).__name__}: {error})",
            )


def instrument(model: Model, client: Any) -> Any:
    """Let every reporter of `model` hook `client`; returns the client."""
    for reporter in reporters(model):
        try:
            reporter.instrument(model, client)
        except Exception as error:
            _warn_once(model, reporter.name, f"could not trace requests ({type(error).__name__}: {error})")
    return client


def links(model: Model) -> list[tuple[str, str]]:
    """(name, url) of each reporter of `model` that has a page to show (the TrainingPanel links to them)."""
    if getattr(model, "_reporters", None) is None:
        return []
    return [(r.name, r.url) for r in model._reporters if getattr(r, "url", None)]


def close(model: Model) -> None:
    """Finish the model's reporters (a backend's close() does it); the next report starts them again."""
    found, model._reporters = getattr(model, "_reporters", None) or [], None
    for reporter in found:
        try:
            reporter.close()
        except Exception as error:
            _warn_once(model, reporter.name, f"did not close cleanly ({type(error).__name__}: {error})")


_warned: set[tuple[int, str]] = set()


def _warn_once(model: Model, who: str, what: str) -> None:
    key = (id(model), who)
    if key in _warned:
        return
    _warned.add(key)
    warn_user(f"artnb: {who} {what}; training goes on without it (this warning is shown once)")


def __getattr__(name: str) -> Any:
    """`art.integrations.enable_langfuse(...)`, `art.integrations.init_weave(...)`: imported on first use."""
    if name == "enable_langfuse":
        from .langfuse_traces import enable_langfuse

        return enable_langfuse
    if name == "init_weave":
        from .weave_init import init_weave

        return init_weave
    raise AttributeError(f"module 'artnb.integrations' has no attribute {name!r}")
