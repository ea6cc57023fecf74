"""load_trajectories over a real run directory written by Model.log, the two charts, and output_dirs paths."""

from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
import pytest

import artnb as art
from artnb.core.store import RunStore
from artnb.utils import output_dirs
from artnb.utils.benchmarking.charts import percentage_comparison_bar_chart, training_progress_chart
from artnb.utils.benchmarking.load_trajectories import load_trajectories
from artnb.utils.benchmarking.types import BenchmarkModelKey

PROJECT = "bench"


def group(wins: list[bool], **group_metadata) -> art.TrajectoryGroup:
    return art.TrajectoryGroup(
        [
            art.Trajectory(
                messages_and_choices=[
                    {"role": "user", "content": "play"},
                    {"role": "assistant", "content": "ok"},
                ],
                reward=float(w),
                metrics={"win_rate": w, "turns": 3},
                metadata={"game": i},
                logs=[f"game {i}"],
            )
            for i, w in enumerate(wins)
        ],
        metadata=group_metadata,
    )


@pytest.fixture(scope="module")
async def art_path(tmp_path_factory):
    """agent-001 logged on val at steps 0-2 (win rate 0.25 -> 0.5 -> 1.0) and train at step 0; a baseline
    logged once on val (win rate 0.5)."""
    path = tmp_path_factory.mktemp("art")
    agent = art.Model(name="agent-001", project=PROJECT, base_path=str(path))
    baseline = art.Model(name="gpt-4.1-mini", project=PROJECT, base_path=str(path))
    await agent.log([group([True, False, False, False], opponent="random")], split="val", step=0)
    await agent.log([group([True, False]), group([False, True])], split="val", step=1)
    await agent.log([group([True, True])], split="val", step=2)
    await agent.log([group([False, False])], split="train", step=0)
    await baseline.log([group([True, False])], split="val", step=0)
    return path


async def test_load_trajectories_reads_every_logged_trajectory(art_path):
    df = await load_trajectories(PROJECT, art_path=str(art_path))

    assert list(df.columns[:7]) == ["model", "split", "step", "reward", "group_number", "messages", "logs"]
    assert {"metric_win_rate", "metric_turns", "metadata_game", "metadata_opponent"} <= set(df.columns)
    assert len(df) == 4 + 4 + 2 + 2 + 2
    counts = df.groupby(["model", "split", "step"]).size().to_dict()
    assert counts == {
        ("agent-001", "train", 0): 2,
        ("agent-001", "val", 0): 4,
        ("agent-001", "val", 1): 4,
        ("agent-001", "val", 2): 2,
        ("gpt-4.1-mini", "val", 0): 2,
    }
    val = df[(df["model"] == "agent-001") & (df["split"] == "val")]
    assert val.groupby("step")["metric_win_rate"].mean().tolist() == [0.25, 0.5, 1.0]
    assert df["group_number"].nunique() == 6  # one per logged group, unique across files
    first = df[(df["model"] == "agent-001") & (df["split"] == "val") & (df["step"] == 0)].iloc[0]
    assert first["metadata_opponent"] == "random" and first["logs"] == ["game 0"]
    assert first["messages"] == [
        {"role": "user", "content": "play", "trainable": False},
        {"role": "assistant", "content": "ok", "trainable": False},
    ]

    only = await load_trajectories(PROJECT, models=["gpt-4.1-mini"], art_path=art_path)
    assert set(only["model"]) == {"gpt-4.1-mini"} and len(only) == 2


async def test_load_trajectories_warns_when_nothing_is_there(tmp_path):
    with pytest.warns(UserWarning, match="no logged trajectories"):
        df = await load_trajectories("nothing-here", art_path=tmp_path)
    assert df.empty and "reward" in df.columns


async def test_training_progress_chart(art_path):
    df = await load_trajectories(PROJECT, art_path=art_path)
    fig = training_progress_chart(
        df,
        "win_rate",
        models=[BenchmarkModelKey("agent-001", "RL agent", "val"), "gpt-4.1-mini"],
        title="Win rate",
        perfect_score=1.0,
    )

    assert isinstance(fig, go.Figure)
    lines = {t.name: t for t in fig.data}
    assert list(lines["RL agent"].x) == [0, 1, 2] and list(lines["RL agent"].y) == [0.25, 0.5, 1.0]
    # the once-logged baseline is a flat dashed line across the trained model's steps
    assert list(lines["gpt-4.1-mini"].x) == [0, 2] and list(lines["gpt-4.1-mini"].y) == [0.5, 0.5]
    assert lines["gpt-4.1-mini"].line.dash == "dash"
    assert lines["RL agent"].legendrank < lines["gpt-4.1-mini"].legendrank  # trained models listed first
    assert fig.layout.title.text == "Win rate" and fig.layout.xaxis.title.text == "Step"
    assert [s.y0 for s in fig.layout.shapes] == [1.0]  # the perfect-score line

    pooled = training_progress_chart(df, "reward")  # no models: every model, splits pooled, as ART does
    assert [t.name for t in pooled.data] == ["gpt-4.1-mini", "agent-001"]

    with pytest.raises(ValueError, match="metrics available"):
        training_progress_chart(df, "accuracy")
    with pytest.raises(ValueError, match="split='train'"):
        training_progress_chart(df, "win_rate", models=[BenchmarkModelKey("agent-001", split="test")])


async def test_percentage_comparison_bar_chart(art_path):
    df = await load_trajectories(PROJECT, art_path=art_path)
    fig = percentage_comparison_bar_chart(df, "win_rate", models=["agent-001", "gpt-4.1-mini"])

    first, change = fig.data
    assert list(first.x) == ["agent-001", "gpt-4.1-mini"] and list(first.y) == [25.0, 50.0]  # shown as %
    assert list(change.x) == ["agent-001"] and list(change.base) == [25.0] and list(change.y) == [75.0]
    assert list(change.text) == ["RL +75%"]
    assert [a.text for a in fig.layout.annotations] == ["<b>100%</b>", "<b>50%</b>"]


def test_savefig_writes_html_or_falls_back_to_it(tmp_path, monkeypatch):
    table = pd.DataFrame({"model": ["m", "m"], "split": ["val", "val"], "step": [0, 1], "reward": [0.0, 1.0]})
    fig = training_progress_chart(table, "reward")
    assert fig.savefig(tmp_path / "chart.html") == tmp_path / "chart.html"
    assert "plotly" in (tmp_path / "chart.html").read_text()

    def no_kaleido(*args, **kwargs):
        raise ValueError("Image export requires the kaleido package")

    monkeypatch.setattr(fig, "write_image", no_kaleido)
    with pytest.warns(UserWarning, match="pip install kaleido"):
        written = fig.savefig(tmp_path / "plots" / "win_rate.png", dpi=300, bbox_inches="tight")  # ART's call
    assert written == tmp_path / "plots" / "win_rate.html" and written.exists()


def test_output_dirs_follow_the_run_store(tmp_path):
    run_dir = output_dirs.get_output_dir_from_model_properties(PROJECT, "agent-001", art_path=tmp_path)
    store = RunStore(tmp_path, PROJECT, "agent-001")
    assert Path(run_dir) == store.dir
    assert (
        Path(output_dirs.get_model_dir(art.Model(name="agent-001", project=PROJECT, base_path=str(tmp_path))))
        == store.dir
    )
    assert Path(output_dirs.get_models_dir(PROJECT, tmp_path)) == store.dir.parent
    assert Path(output_dirs.get_step_checkpoint_dir(run_dir, 7)) == store.checkpoint_path(7)
    assert Path(output_dirs.get_trajectories_split_dir(run_dir, "val")) == store.trajectories_dir("val")
    assert Path(output_dirs.get_trajectories_dir(run_dir)) == store.dir / "trajectories"
    with pytest.raises(ValueError, match="run directory"):
        output_dirs.get_step_checkpoint_dir(tmp_path, 1)
