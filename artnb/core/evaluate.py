"""Evaluation: the same scenarios played by several models, as one tidy table.

Every tutorial ends by asking "did training help?": the trained model against its base model (and any hosted
`art.Model`) on the same evaluation games. `evaluate` plays every (model, scenario) pair concurrently behind one
progress bar and returns one row per game, so the comparison is a pandas `groupby` or
`artnb.plots.evaluation_figure(table)` away. Nothing is trained or logged here; pass the trajectories to
`model.log(..., split="val")` yourself if you want them in the run's history.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import pandas as pd

from .gather import gather_trajectories
from .model import Model
from .trajectory import Trajectory

Rollout = Callable[..., Awaitable[Trajectory]]


async def evaluate(
    rollout: Rollout,
    models: Mapping[str, Model],
    scenarios: Iterable[Any],
    *,
    max_exceptions: int | float = 0,
    pbar_desc: str = "evaluate",
    **rollout_kwargs: Any,
) -> pd.DataFrame:
    """Play `rollout(model, scenario, **rollout_kwargs)` for each model and scenario; one row per game.

    Columns: `model` (the label in `models`), `scenario`, `reward`, one column per trajectory metric, and
    `error` (the exception text where a rollout failed and `max_exceptions` tolerated it; else empty).

    >>> table = await art.evaluate(tic_tac_toe.rollout, {"base": model.as_base_model(), "trained": model},
    ...                            range(1000, 1020), temperature=0)
    >>> table.groupby("model")["reward"].mean()
    """
    if not models:
        raise ValueError("evaluate() needs at least one model: pass {'label': model, ...}")
    scenarios = list(scenarios)
    if not scenarios:
        raise ValueError("evaluate() needs at least one scenario")
    pairs = [(label, scenario) for label in models for scenario in scenarios]
    results = await gather_trajectories(
        (rollout(models[label], scenario, **rollout_kwargs) for label, scenario in pairs),
        pbar_desc=pbar_desc,
        max_exceptions=max_exceptions,
    )
    rows = []
    for (label, scenario), result in zip(pairs, results, strict=True):
        row: dict[str, Any] = {"model": label, "scenario": scenario}
        if isinstance(result, BaseException):
            rows.append({**row, "reward": math.nan, "error": f"{type(result).__name__}: {result}"})
            continue
        for traj in result if isinstance(result, list) else [result]:
            rows.append({**row, "reward": traj.reward, **numeric_metrics(traj), "error": ""})
    return pd.DataFrame(rows)


def numeric_metrics(traj: Trajectory) -> dict[str, float]:
    """A trajectory's metrics that are numbers (bools as 0/1), as floats: the columns of an evaluation table."""
    return {k: float(v) for k, v in traj.metrics.items() if isinstance(v, (int, float, bool))}


def summarize_evaluation(table: pd.DataFrame, metrics: Iterable[str] = ("reward",)) -> pd.DataFrame:
    """Mean, standard deviation and game count of each metric per model, in the order the models were given."""
    metrics = list(metrics)
    missing = [m for m in metrics if m not in table.columns]
    if missing:
        raise KeyError(f"no column {missing} in the evaluation table; it has {sorted(table.columns)}")
    order = list(dict.fromkeys(table["model"]))
    summary = table.groupby("model", sort=False)[metrics].agg(["mean", "std", "count"])
    return summary.loc[order]
