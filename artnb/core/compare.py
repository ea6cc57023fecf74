"""Independent rewards beside RULER scores: the table a reward-debugging session reads.

Where a hand-written reward and the judge disagree on which trajectory of a group is better, one of them is
wrong, and those rows are the ones worth reading. `compare_rewards` ranks both within each group (1 = best,
ties share the average rank), measures the disagreement per trajectory, and the rank correlation (Spearman)
per group. It reads only what `ruler_score_group` stored, so it never calls a judge; trajectories that were
not scored get NaN in the RULER columns.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import pandas as pd

from .trajectory import TrajectoryGroup

TRAJECTORY_COLUMNS = [
    "group",
    "trajectory",
    "independent_reward",
    "ruler_score",
    "reward",
    "independent_rank",
    "ruler_rank",
    "disagreement",
    "explanation",
]
GROUP_COLUMNS = ["group", "size", "spearman", "mean_independent", "mean_ruler"]


@dataclass
class RewardComparison:
    """`trajectories`: one row per trajectory; `groups`: one row per group (columns as in the module doc)."""

    trajectories: pd.DataFrame
    groups: pd.DataFrame


def compare_rewards(groups: TrajectoryGroup | Iterable[TrajectoryGroup]) -> RewardComparison:
    """Compare each trajectory's own reward with its RULER score, within each group.

    Example:
        scored = [await art.ruler_score_group(g, judge) for g in groups]
        cmp = art.compare_rewards(scored)
        cmp.groups.sort_values("spearman").head()        # groups where judge and reward disagree most
        cmp.trajectories.sort_values("disagreement", ascending=False).head()
    """
    group_list = [groups] if isinstance(groups, TrajectoryGroup) else list(groups)
    rows = []
    for gi, group in enumerate(group_list):
        for ti, t in enumerate(group.trajectories):
            ruler = t.metrics.get("ruler_score")
            rows.append(
                {
                    "group": gi,
                    "trajectory": ti,
                    "independent_reward": float(t.metrics.get("independent_reward", t.reward)),
                    "ruler_score": math.nan if ruler is None else float(ruler),
                    "reward": float(t.reward),
                    "explanation": str(t.metadata.get("ruler_explanation") or ""),
                }
            )
    if not rows:
        traj = pd.DataFrame(columns=TRAJECTORY_COLUMNS)
    else:
        traj = pd.DataFrame(rows)
        by_group = traj.groupby("group")
        traj["independent_rank"] = by_group["independent_reward"].rank(ascending=False, method="average")
        traj["ruler_rank"] = by_group["ruler_score"].rank(ascending=False, method="average")
        traj["disagreement"] = (traj["independent_rank"] - traj["ruler_rank"]).abs().astype(float)
        traj = traj[TRAJECTORY_COLUMNS]
    summary = []
    for gi, group in enumerate(group_list):
        rows_g = traj[traj["group"] == gi]
        summary.append(
            {
                "group": gi,
                "size": len(group.trajectories),
                "spearman": _spearman(rows_g["independent_reward"], rows_g["ruler_score"]),
                "mean_independent": _mean(rows_g["independent_reward"]),
                "mean_ruler": _mean(rows_g["ruler_score"]),
            }
        )
    return RewardComparison(trajectories=traj, groups=pd.DataFrame(summary, columns=GROUP_COLUMNS))


def _spearman(a: pd.Series, b: pd.Series) -> float:
    """Rank correlation over the rows where both are known; NaN with fewer than 2 or a constant side."""
    both = pd.DataFrame({"a": a, "b": b}).dropna().astype(float)
    if len(both) < 2 or both["a"].nunique() < 2 or both["b"].nunique() < 2:
        return math.nan
    ranks = both.rank(method="average")
    return float(ranks["a"].corr(ranks["b"]))


def _mean(values: pd.Series) -> float:
    values = values.dropna().astype(float)
    return float(values.mean()) if len(values) else math.nan
