"""RewardPlot state: traces after history rows, metric and band switches, a finished run read from disk."""

import gc
import weakref

import pandas as pd
import pytest

import artnb as art
from artnb.core.store import RunStore
from artnb.plots import reward_figure
from artnb.widgets import RewardPlot
from artnb.widgets.group_view import close_tree


def log_step(store: RunStore, step: int, rewards: list[float]) -> None:
    group = art.TrajectoryGroup([art.Trajectory(reward=r, metrics={"win": r > 0.5}) for r in rewards])
    store.write_trajectories("train", step, [group])
    mean = sum(rewards) / len(rewards)
    store.append_history(
        {
            "step": step,
            "split": "train",
            "train/reward": mean,
            "train/reward_std_dev": 0.1,
            "train/loss": 1.0 / (step + 1),
        }
    )


def test_gains_a_point_per_logged_step_and_reads_a_run_dir(tmp_path):
    store = RunStore(tmp_path, "proj", "agent")
    plot = RewardPlot(store)
    assert plot.points == {} and "no 'reward' logged yet" in plot.note.value
    log_step(store, 0, [0.0, 1.0])
    plot.refresh()
    assert plot.points == {"train": 1} and plot.note.value == ""
    log_step(store, 1, [0.5, 1.0])
    plot.refresh()
    assert plot.points == {"train": 2}
    band, line = plot.figure.data
    assert band.fill == "toself" and band.name == "train ± std within groups"
    assert list(line.y) == [0.5, 0.75] and list(line.x) == [0, 1]
    assert list(plot.metric.options) == ["reward", "loss", "reward_std_dev"]

    plot.band.value = "range"
    band, line = plot.figure.data
    assert band.name == "train min–max over trajectories" and list(band.y) == [1.0, 1.0, 0.5, 0.0]
    plot.band.value = "none"
    assert len(plot.figure.data) == 1
    plot.metric.value = "loss"
    assert list(plot.figure.data[0].y) == [1.0, 0.5] and plot.figure.layout.yaxis.title.text == "loss"

    finished = RewardPlot(tmp_path / "proj" / "models" / "agent", band="range")
    assert finished.points == {"train": 2} and finished.figure.data[0].meta["role"] == "band"
    with pytest.raises(ValueError, match="history.jsonl"):
        RewardPlot(tmp_path)


def test_from_a_history_frame_with_splits():
    history = pd.DataFrame(
        [
            {"step": 0, "split": "train", "train/reward": 0.1},
            {"step": 0, "split": "val", "val/reward": 0.2},
            {"step": 1, "split": "val", "val/reward": 0.4},
        ]
    )
    plot = RewardPlot(history, title="tic-tac-toe")
    assert plot.points == {"train": 1, "val": 2}
    assert plot.figure.layout.title.text == "tic-tac-toe"
    static = reward_figure(history, title="tic-tac-toe")  # the HTML report's figure draws the same traces
    assert [t.name for t in static.data] == [t.name for t in plot.figure.data]


async def test_a_plot_of_a_model_gains_points_as_the_model_records_steps(tmp_path):
    model = art.Model(name="agent", project="proj", base_path=str(tmp_path))
    plot = RewardPlot(model, metric="val/reward")
    assert plot.points == {} and "points appear as the model records steps" in plot.note.value
    await model.log(art.TrajectoryGroup([art.Trajectory(reward=r) for r in (0.0, 1.0)]), step=0)
    assert plot.points == {"val": 1}  # no refresh() call
    await model.log(art.TrajectoryGroup([art.Trajectory(reward=r) for r in (1.0, 1.0)]), step=1)
    assert plot.points == {"val": 2} and list(plot.figure.data[-1].y) == [0.5, 1.0]

    from_disk = RewardPlot(model.store.dir)
    await model.log(art.TrajectoryGroup([art.Trajectory(reward=1.0)]), step=2)
    assert from_disk.points == {"val": 2}  # a run directory is redrawn on refresh() only
    from_disk.refresh()
    assert from_disk.points == {"val": 3}

    close_tree(plot)  # closed with its parts: only the model could still hold it
    gone = weakref.ref(plot)
    del plot
    gc.collect()
    assert gone() is None  # the model does not keep a plot nobody shows alive
