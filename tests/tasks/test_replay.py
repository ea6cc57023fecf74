"""The shipped recording: real games of the embedded model, loadable without an engine."""

import pytest

import artnb as art
from artnb.tasks import replay


def test_recorded_groups_load_as_trajectory_groups():
    groups = replay.load("tic_tac_toe")
    assert len(groups) == 4 and all(isinstance(g, art.TrajectoryGroup) and len(g) == 8 for g in groups)
    traj = groups[0].trajectories[0]
    assert traj.messages()[0]["role"] == "system" and "tic-tac-toe" in traj.messages()[0]["content"]
    assert {"win", "legal_move_rate"} <= set(traj.metrics)
    assert len({t.reward for g in groups for t in g}) > 1  # rewards differ: GRPO and RULER have signal
    assert art.compare_rewards(groups).trajectories["independent_reward"].notna().all()


def test_unknown_recording_is_named():
    with pytest.raises(KeyError, match="no recording named 'chess'; recorded: \\['tic_tac_toe'\\]"):
        replay.load("chess")
