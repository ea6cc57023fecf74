"""Evaluation: the same scenarios played by several models, as one tidy table.

Every tutorial ends by asking "did training help?": the trained model against its base model (and any hosted
`art.Model`) on the same evaluation games. `evaluate` plays every (model, scenario) pair concurrently behind one
progress bar and returns one row per game, so the comparison is a pandas `groupby` or
`artnb.plots.evaluation_figure(table)` away. Nothing is trained or logged here; pass the trajectories to
`model.log(..., split="val")` yourself if you want them in the run's history.

Greedy games (`temperature=0`) show what the model does most often; they cannot show a policy that sharpened a
preference it already had, which is much of what a few RL steps do to a small model: its greedy games stay the
same move for move. Sampled games (`temperature=1, samples=k`) see the whole distribution, so an evaluation
that asks whether training changed anything plays both. Every mean comes with a 95% bootstrap interval over the
scenarios (`core.intervals`), and `paired_difference` gives trained minus base scenario by scenario. A table
with a `run` column (several training seeds, concatenated) gets intervals over seeds and scenarios.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import pandas as pd

from .capture import own_or_captured
from .gather import gather_trajectories
from .intervals import MIN_VALUES_FOR_A_VERDICT, Interval, bootstrap_mean
from .model import Model
from .trajectory import Trajectory

Rollout = Callable[..., Awaitable[Trajectory]]


async def evaluate(
    rollout: Rollout,
    models: Mapping[str, Model],
    scenarios: Iterable[Any],
    *,
    samples: int = 1,
    max_concurrent: int | None = None,
    max_exceptions: int | float = 0,
    pbar_desc: str = "evaluate",
    **rollout_kwargs: Any,
) -> pd.DataFrame:
    """Play `rollout(model, scenario, **rollout_kwargs)` `samples` times for each model and scenario; one row
    per game.

    Columns: `model` (the label in `models`), `scenario`, `sample` (0 to samples - 1), `reward`, one column per
    trajectory metric, and `error` (the exception text where a rollout failed and `max_exceptions` tolerated
    it; else empty). Pass `temperature=1, samples=4` for sampled games; greedy games (`temperature=0`) repeat
    themselves, so they need one sample. `max_concurrent` bounds the games in flight: a multi-turn game reuses
    its history from the engine's prefix cache only while the cache holds it, so on a small KV cache (vLLM on
    a CPU) a few dozen games at a time finish sooner than hundreds at once; None plays them all at once.

    >>> table = await art.evaluate(tic_tac_toe.rollout, {"base": model.as_base_model(), "trained": model},
    ...                            range(1000, 1020), temperature=0)
    >>> table.groupby("model")["reward"].mean()
    """
    if not models:
        raise ValueError("evaluate() needs at least one model: pass {'label': model, ...}")
    scenarios = list(scenarios)
    if not scenarios:
        raise ValueError("evaluate() needs at least one scenario")
    if samples < 1:
        raise ValueError(f"samples={samples}: play each scenario at least once")
    if max_concurrent is not None and max_concurrent < 1:
        raise ValueError(f"max_concurrent={max_concurrent}: allow at least one game at a time (None: all)")
    games = [(label, s, k) for label in models for s in scenarios for k in range(samples)]
    slots = asyncio.Semaphore(max_concurrent or len(games))

    async def play(label: str, scenario: Any) -> Trajectory | list[Trajectory]:
        async with slots:
            return await own_or_captured(rollout(models[label], scenario, **rollout_kwargs))

    results = await gather_trajectories(
        (play(label, scenario) for label, scenario, _ in games),
        pbar_desc=pbar_desc,
        max_exceptions=max_exceptions,
    )
    rows = []
    for (label, scenario, sample), result in zip(games, results, strict=True):
        row: dict[str, Any] = {"model": label, "scenario": scenario, "sample": sample}
        if isinstance(result, BaseException):
            rows.append({**row, "reward": math.nan, "error": f"{type(result).__name__}: {result}"})
            continue
        for traj in result if isinstance(result, list) else [result]:
            rows.append({**row, "reward": traj.reward, **numeric_metrics(traj), "error": ""})
    return pd.DataFrame(rows)


async def evaluate_greedy_and_sampled(
    rollout: Rollout,
    models: Mapping[str, Model],
    scenarios: Iterable[Any],
    *,
    samples: int = 4,
    max_concurrent: int | None = None,
    **rollout_kwargs: Any,
) -> pd.DataFrame:
    """Each model plays every scenario once greedily (temperature 0) and `samples` times sampled (temperature 1):
    one table, its `mode` column "greedy" or "sampled" (`samples=0`: greedy only). The rollout must take
    `temperature`.

    >>> table = await art.evaluate_greedy_and_sampled(rollout, {"base": base, "trained": model}, held_out)
    >>> for mode, games in table.groupby("mode"): print(mode, art.compare_evaluation(games, ["reward"]))
    """
    scenarios = list(scenarios)
    common = {"max_concurrent": max_concurrent, **rollout_kwargs}
    greedy = await evaluate(rollout, models, scenarios, temperature=0, pbar_desc="greedy games", **common)
    tables = [greedy.assign(mode="greedy")]
    if samples:
        sampled = await evaluate(
            rollout, models, scenarios, temperature=1.0, samples=samples, pbar_desc="sampled games", **common
        )
        tables.append(sampled.assign(mode="sampled"))
    return pd.concat(tables, ignore_index=True)


def numeric_metrics(traj: Trajectory) -> dict[str, float]:
    """A trajectory's metrics that are numbers (bools as 0/1), as floats: the columns of an evaluation table."""
    return {k: float(v) for k, v in traj.metrics.items() if isinstance(v, (int, float, bool))}


def summarize_evaluation(
    table: pd.DataFrame, metrics: Iterable[str] = ("reward",), *, confidence: float = 0.95
) -> pd.DataFrame:
    """Per model, in the order the models were given: each metric's mean, standard deviation, game count, and
    the `low` and `high` ends of its `confidence` interval (bootstrap over scenarios, and over runs when the
    table has a `run` column; a scenario played several times counts once, at its mean)."""
    metrics = list(metrics)
    missing = [m for m in metrics if m not in table.columns]
    if missing:
        raise KeyError(f"no column {missing} in the evaluation table; it has {sorted(table.columns)}")
    order = list(dict.fromkeys(table["model"]))
    summary = table.groupby("model", sort=False)[metrics].agg(["mean", "std", "count"])
    for metric in metrics:
        ends = {
            label: _scenario_interval(table[table["model"] == label], metric, confidence) for label in order
        }
        summary[(metric, "low")] = [ends[label][0] for label in summary.index]
        summary[(metric, "high")] = [ends[label][1] for label in summary.index]
    return summary[[(m, c) for m in metrics for c in ("mean", "std", "count", "low", "high")]].loc[order]


def paired_difference(
    table: pd.DataFrame,
    metric: str = "reward",
    *,
    model: str | None = None,
    baseline: str = "base",
    confidence: float = 0.95,
) -> Interval:
    """`model` minus `baseline` on `metric`, scenario by scenario, with its bootstrap interval.

    Each (run, scenario) played by both models is one paired value: the model's mean on it minus the baseline's.
    `model=None` takes the table's one other model. When the interval excludes 0 the sign of the difference is
    established at that confidence; when it holds 0, these games cannot tell the two models apart.

    >>> diff = art.paired_difference(table, "reward", model="trained", baseline="base")
    >>> print(diff, "helped" if diff.low > 0 else "not shown")
    """
    labels = list(dict.fromkeys(table["model"]))
    if baseline not in labels:
        raise ValueError(f"no games of baseline {baseline!r} in the table; its models are {labels}")
    if model is None:
        others = [label for label in labels if label != baseline]
        if len(others) != 1:
            raise ValueError(f"the table has models {labels}: name the one to compare with model=...")
        model = others[0]
    if model not in labels:
        raise ValueError(f"no games of model {model!r} in the table; its models are {labels}")
    if metric not in table.columns:
        raise KeyError(f"no column {metric!r} in the evaluation table; it has {sorted(table.columns)}")
    keys = _pair_keys(table)
    played = table[table["model"].isin([model, baseline])].dropna(subset=[metric])
    means = played.groupby([*keys, "model"])[metric].mean().unstack("model")
    both = model in means.columns and baseline in means.columns
    pairs = means.dropna(subset=[model, baseline]) if both else means.iloc[:0]
    if pairs.empty:
        raise ValueError(
            f"no scenario was played by both {model!r} and {baseline!r} without an error: evaluate both "
            "models on the same scenarios"
        )
    runs = pairs.index.get_level_values("run").tolist() if "run" in keys else None
    return bootstrap_mean((pairs[model] - pairs[baseline]).tolist(), runs, confidence=confidence)


def _pair_keys(table: pd.DataFrame) -> list[str]:
    return ["run", "scenario"] if "run" in table.columns else ["scenario"]


def _scenario_interval(rows: pd.DataFrame, metric: str, confidence: float) -> tuple[float, float]:
    keys = _pair_keys(rows)
    per = rows.dropna(subset=[metric]).groupby(keys)[metric].mean()
    if per.empty:
        return math.nan, math.nan
    runs = per.index.get_level_values("run").tolist() if "run" in keys else None
    interval = bootstrap_mean(per.tolist(), runs, confidence=confidence)
    return interval.low, interval.high


def compare_evaluation(
    table: pd.DataFrame,
    metrics: Iterable[str] = ("reward",),
    *,
    model: str | None = None,
    baseline: str = "base",
    confidence: float = 0.95,
) -> pd.DataFrame:
    """One row per metric: the baseline's and the model's means with their intervals, and the paired difference
    (model - baseline) with its interval; `shown` says whether that interval excludes 0 and rests on at least
    MIN_VALUES_FOR_A_VERDICT (6) scenarios (fewer cannot establish a sign, however narrow the interval looks).

    >>> art.compare_evaluation(table, ["reward", "win"])   # base vs trained on the same scenarios
    """
    summary = summarize_evaluation(table, metrics, confidence=confidence)
    rows = []
    for metric in summary.columns.get_level_values(0).unique():
        diff = paired_difference(table, metric, model=model, baseline=baseline, confidence=confidence)
        other = model or next(label for label in summary.index if label != baseline)
        rows.append(
            {
                "metric": metric,
                baseline: summary.loc[baseline, (metric, "mean")],
                f"{baseline} low": summary.loc[baseline, (metric, "low")],
                f"{baseline} high": summary.loc[baseline, (metric, "high")],
                other: summary.loc[other, (metric, "mean")],
                f"{other} low": summary.loc[other, (metric, "low")],
                f"{other} high": summary.loc[other, (metric, "high")],
                "difference": diff.mean,
                "low": diff.low,
                "high": diff.high,
                "scenarios": diff.n,
                "runs": diff.runs,
                "shown": diff.establishes(0.0),
            }
        )
    return pd.DataFrame(rows).set_index("metric")


def format_comparison(comparison: pd.DataFrame) -> str:
    """`compare_evaluation`'s table as aligned text: each mean with its interval, then the verdict."""
    labels = [c for c in comparison.columns[:6:3]]
    width = max(16, *(len(label) + 2 for label in labels))
    lines = [f"{'metric':<18}" + "".join(f"{label:>{width + 8}}" for label in labels) + f"{'difference':>26}"]
    for metric, row in comparison.iterrows():
        cells = [
            f"{row[label]:.3f} [{row[f'{label} low']:.3f}, {row[f'{label} high']:.3f}]" for label in labels
        ]
        diff = f"{row['difference']:+.3f} [{row['low']:+.3f}, {row['high']:+.3f}]"
        if row["shown"]:
            verdict = "shown"
        elif row["scenarios"] < MIN_VALUES_FOR_A_VERDICT:
            verdict = f"not shown (too few scenarios: {int(row['scenarios'])} < {MIN_VALUES_FOR_A_VERDICT})"
        else:
            verdict = "not shown (interval holds 0)"
        lines.append(f"{metric:<18}" + "".join(f"{c:>{width + 8}}" for c in cells) + f"{diff:>26}  {verdict}")
    return "\n".join(lines)
