"""Reward-plot numbers: metric names, the mean line and both kinds of band, from history and parquet files."""

import math

import pandas as pd
import pytest

import artnb as art
from artnb.core.curves import curves, metric_names, trajectory_values
from artnb.core.store import RunStore


def history() -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                "step": 0,
                "split": "train",
                "train/reward": 0.2,
                "train/reward_std_dev": 0.1,
                "train/loss": 1.0,
            },
            {
                "step": 1,
                "split": "train",
                "train/reward": 0.4,
                "train/reward_std_dev": 0.2,
                "train/loss": 0.5,
            },
            {"step": 0, "split": "val", "val/reward": 0.1, "val/win": 0.0},
            {"step": 0, "split": "val", "val/reward": 0.3, "val/win": 1.0},  # two val logs at one step
            {"step": 1, "split": "train", "data/num_tokens": 300.0},
        ]
    )


def test_metric_names_strip_split_prefixes_reward_first():
    assert metric_names(history()) == ["reward", "data/num_tokens", "loss", "reward_std_dev", "win"]
    assert metric_names(pd.DataFrame(columns=["step", "split"])) == []


def test_mean_line_and_within_group_std_band():
    train, val = curves(history(), "reward", band="std")
    assert (train.split, train.steps, train.mean) == ("train", [0, 1], [0.2, 0.4])
    assert train.lower == pytest.approx([0.1, 0.2]) and train.upper == pytest.approx([0.3, 0.6])
    assert train.band_label == "± std within groups"
    assert (val.steps, val.mean, val.lower) == ([0], [pytest.approx(0.2)], None)  # no std logged for val
    assert [c.split for c in curves(history(), "win")] == ["val"]
    assert curves(history(), "data/num_tokens")[0].mean == [300.0]
    assert curves(history(), "reward", band="none")[0].lower is None
    with pytest.raises(ValueError, match="choose 'std', 'range' or 'none'"):
        curves(history(), band="minmax")


def test_range_band_from_logged_trajectories(tmp_path):
    store = RunStore(tmp_path, "p", "m")
    for step, rewards in [(0, [0.0, 1.0, 0.5]), (1, [0.2, 0.4, 0.9])]:
        group = art.TrajectoryGroup([art.Trajectory(reward=r, metrics={"win": r > 0.6}) for r in rewards])
        store.write_trajectories("train", step, [group])
    values = trajectory_values(store, "train")
    assert sorted(values["step"].unique()) == [0, 1] and set(values["win"]) == {0.0, 1.0}
    hist = pd.DataFrame(
        [
            {"step": s, "split": "train", "train/reward": r, "train/win": w}
            for s, r, w in [(0, 0.5, 1 / 3), (1, 0.5, 1 / 3)]
        ]
    )
    (c,) = curves(hist, "reward", band="range", values=lambda split: trajectory_values(store, split))
    assert (c.lower, c.upper, c.band_label) == ([0.0, 0.2], [1.0, 0.9], "min–max over trajectories")
    (w,) = curves(hist, "win", band="std", values=lambda split: trajectory_values(store, split))
    assert w.band_label == "± std over trajectories"
    assert w.upper[0] == pytest.approx(1 / 3 + math.sqrt(2) / 3)
    assert trajectory_values(RunStore(tmp_path, "p", "nothing"), "train").empty
