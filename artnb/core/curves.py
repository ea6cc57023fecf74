"""Per-step curves for reward plots: a mean line per split and a band for the spread, as plain data.

The line comes from the history (`history.jsonl`: one row per split and step), so any logged metric can be
plotted, trainer metrics included. The band has two sources, and its label says which one it is:
- "std": the history's within-group std (`{split}/reward_std_dev`, what GRPO's advantages divide by) when
  logged, else the std over the step's trajectories;
- "range": min to max over the step's trajectories.
Trajectory values come from the logged parquet files (`trajectories/{split}/{step:04d}.parquet`), read once
per file version, so a plot refreshed after every step reads only the new file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pandas as pd

from .metric_names import split_metric, std_of
from .store import RunStore

Band = Literal["std", "range", "none"]
_NOT_METRICS = {"step", "split", "recorded_at"}


@dataclass
class Curve:
    split: str
    metric: str
    steps: list[int]
    mean: list[float]
    lower: list[float] | None = None  # band, same length as steps; None when no spread is known
    upper: list[float] | None = None
    band_label: str | None = None  # what the band is, for the legend


def metric_names(history: pd.DataFrame) -> list[str]:
    """Metrics a history can plot: split prefixes stripped ("train/reward" -> "reward"), reward first."""
    splits = set(history["split"].dropna().unique()) if "split" in history else set()
    names: set[str] = set()
    for col in history.columns:
        if col in _NOT_METRICS or not pd.api.types.is_numeric_dtype(history[col]):
            continue
        prefix, _, rest = col.partition("/")
        names.add(rest if prefix in splits and rest else col)
    ordered = sorted(names)
    if "reward" in names:
        ordered.remove("reward")
        ordered.insert(0, "reward")
    return ordered


def curves(
    history: pd.DataFrame,
    metric: str = "reward",
    band: Band = "std",
    values: Callable[[str], pd.DataFrame] | None = None,
) -> list[Curve]:
    """One curve per split that logged `metric`; `values(split)` gives per-trajectory rows for the band."""
    if band not in ("std", "range", "none"):
        raise ValueError(f"band={band!r}: choose 'std', 'range' or 'none'")
    out = []
    splits = sorted(history["split"].dropna().unique()) if "split" in history else []
    for split in splits:
        rows = history[history["split"] == split]
        col = split_metric(split, metric) if split_metric(split, metric) in rows else metric
        if col not in rows or col in _NOT_METRICS:
            continue
        means = rows.dropna(subset=[col]).groupby("step")[col].mean()
        if means.empty:
            continue
        curve = Curve(split, metric, [int(s) for s in means.index], [float(v) for v in means])
        _add_band(curve, rows, band, values)
        out.append(curve)
    return out


def _add_band(
    curve: Curve, rows: pd.DataFrame, band: Band, values: Callable[[str], pd.DataFrame] | None
) -> None:
    if band == "none":
        return
    std_col = split_metric(curve.split, std_of(curve.metric))
    if band == "std" and std_col in rows:
        std = rows.dropna(subset=[std_col]).groupby("step")[std_col].mean()
        s = [float(std.get(step, 0.0)) for step in curve.steps]
        curve.lower = [m - d for m, d in zip(curve.mean, s, strict=True)]
        curve.upper = [m + d for m, d in zip(curve.mean, s, strict=True)]
        curve.band_label = "± std within groups"
        return
    per_traj = values(curve.split) if values is not None else None
    if per_traj is None or per_traj.empty or curve.metric not in per_traj:
        return
    by_step = per_traj.dropna(subset=[curve.metric]).groupby("step")[curve.metric]
    if band == "std":
        mean, std = by_step.mean(), by_step.std(ddof=0)
        lo, hi = mean - std, mean + std
        label = "± std over trajectories"
    else:
        lo, hi = by_step.min(), by_step.max()
        label = "min–max over trajectories"
    if not any(step in lo.index for step in curve.steps):
        return
    # Where a step has no trajectory file (e.g. metrics logged alone), the band collapses onto the line.
    curve.lower = [float(lo.get(step, m)) for step, m in zip(curve.steps, curve.mean, strict=True)]
    curve.upper = [float(hi.get(step, m)) for step, m in zip(curve.steps, curve.mean, strict=True)]
    curve.band_label = label


_cache: dict[Path, tuple[tuple[int, int], pd.DataFrame]] = {}


def trajectory_values(store: RunStore, split: str) -> pd.DataFrame:
    """Reward and metrics of every logged trajectory of a split: columns step, group_index, reward, <metrics>."""
    folder = store.trajectories_dir(split)
    frames = []
    for path in sorted(folder.glob("[0-9]*.parquet")) if folder.is_dir() else []:
        stat = path.stat()
        key = (stat.st_mtime_ns, stat.st_size)
        hit = _cache.get(path)
        if hit is None or hit[0] != key:
            hit = (key, _read_values(path))
            _cache[path] = hit
        frames.append(hit[1])
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=["step", "reward"])


def _read_values(path: Path) -> pd.DataFrame:
    df = pd.read_parquet(path, columns=["group_index", "reward", "metrics"])
    metrics = [json.loads(m) for m in df["metrics"]]
    rows = []
    for gi, reward, ms in zip(df["group_index"], df["reward"], metrics, strict=True):
        row = {"step": int(path.stem), "group_index": int(gi), "reward": float(reward)}
        for k, v in ms.items():
            if isinstance(v, (int, float)) and math.isfinite(float(v)):
                row[k] = float(v)
        rows.append(row)
    return pd.DataFrame(rows)
