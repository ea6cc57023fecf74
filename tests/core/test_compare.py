"""compare_rewards: the per-trajectory and per-group tables the reward-debugging widget shows."""

from __future__ import annotations

import math

import pytest

import artnb as art
from artnb.core.compare import GROUP_COLUMNS, TRAJECTORY_COLUMNS


def scored(independent: list[float], ruler: list[float], explanation: str = "why") -> art.TrajectoryGroup:
    """A group as ruler_score_group leaves it: reward = RULER score, both kept in metrics."""
    return art.TrajectoryGroup(
        art.Trajectory(
            reward=r,
            metrics={"independent_reward": i, "ruler_score": r},
            metadata={"ruler_explanation": f"{explanation} {k}"},
        )
        for k, (i, r) in enumerate(zip(independent, ruler, strict=True))
    )


def test_ranks_disagreement_and_correlation():
    agree = scored([1.0, 0.0, 0.5], [0.9, 0.1, 0.4])
    reversed_ = scored([1.0, 0.5, 0.0], [0.0, 0.5, 1.0])
    cmp = art.compare_rewards([agree, reversed_])
    t, g = cmp.trajectories, cmp.groups
    assert isinstance(cmp, art.RewardComparison)
    assert list(t.columns) == TRAJECTORY_COLUMNS and list(g.columns) == GROUP_COLUMNS
    assert t["group"].tolist() == [0, 0, 0, 1, 1, 1] and t["trajectory"].tolist() == [0, 1, 2, 0, 1, 2]
    assert t["independent_rank"].tolist() == [1, 3, 2, 1, 2, 3]
    assert t["ruler_rank"].tolist() == [1, 3, 2, 3, 2, 1]
    assert t["disagreement"].tolist() == [0, 0, 0, 2, 0, 2] and t["disagreement"].dtype == float
    assert t["reward"].tolist() == [0.9, 0.1, 0.4, 0.0, 0.5, 1.0]
    assert t["explanation"].tolist()[:2] == ["why 0", "why 1"]
    assert g["spearman"].tolist() == pytest.approx([1.0, -1.0])
    assert g["size"].tolist() == [3, 3]
    assert g["mean_independent"].tolist() == pytest.approx([0.5, 0.5])
    assert g["mean_ruler"].tolist() == pytest.approx([1.4 / 3, 0.5])


def test_ties_share_the_average_rank_and_constant_scores_have_no_correlation():
    cmp = art.compare_rewards(scored([1.0, 1.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]))
    assert cmp.trajectories["independent_rank"].tolist() == [1.5, 1.5, 3.5, 3.5]
    assert cmp.trajectories["ruler_rank"].tolist() == [2.5] * 4
    assert math.isnan(cmp.groups["spearman"][0])


def test_unscored_trajectories_get_nan_ruler_columns():
    plain = art.TrajectoryGroup([art.Trajectory(reward=0.2), art.Trajectory(reward=0.7)])
    cmp = art.compare_rewards([plain, scored([0.0, 1.0], [0.3, 0.6])])
    first = cmp.trajectories[cmp.trajectories["group"] == 0]
    assert first["independent_reward"].tolist() == [0.2, 0.7] and first["independent_rank"].tolist() == [2, 1]
    assert first[["ruler_score", "ruler_rank", "disagreement"]].isna().all().all()
    assert first["explanation"].tolist() == ["", ""]
    assert math.isnan(cmp.groups["spearman"][0]) and math.isnan(cmp.groups["mean_ruler"][0])
    assert cmp.groups["spearman"][1] == pytest.approx(1.0)


def test_single_group_and_empty_input():
    one = art.compare_rewards(scored([0.0, 1.0], [1.0, 0.0]))
    assert len(one.trajectories) == 2 and one.groups["spearman"][0] == pytest.approx(-1.0)
    empty = art.compare_rewards([art.TrajectoryGroup([])])
    assert list(empty.trajectories.columns) == TRAJECTORY_COLUMNS and empty.trajectories.empty
    assert empty.groups["size"].tolist() == [0] and math.isnan(empty.groups["spearman"][0])
    none = art.compare_rewards([])
    assert none.trajectories.empty and none.groups.empty and list(none.groups.columns) == GROUP_COLUMNS
