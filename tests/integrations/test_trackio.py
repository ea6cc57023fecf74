"""Trackio reporting with the real `trackio` package and its local SQLite database: the run's metrics, traces
and config are read back through Trackio's own storage and compared with the model's history; a restarted
kernel resumes the same run; `run_name` names it."""

from __future__ import annotations

import os
import sys
import tempfile

import pytest
from tiny_loop import gather

import artnb as art
from artnb.models import tiny

# Trackio reads $TRACKIO_DIR when it is first imported; this module's tests keep its database out of ~/.cache.
assert "trackio" not in sys.modules, "trackio was imported before its test could choose where it writes"
os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="artnb-trackio-")

BASE = tiny(hidden_size=64, num_layers=2, seed=1)


async def test_a_run_records_history_traces_and_config_and_resumes(tmp_path):
    from trackio.sqlite_storage import SQLiteStorage

    def make():
        return art.TrainableModel(
            name="agent", project="tk", base_model=BASE, run_name="first try", report_metrics=["trackio"]
        )

    model = make()
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        for step in range(2):
            await model.train(await gather(model, step), config=art.TrainConfig(learning_rate=1e-2))
            model.update_wandb_config({"experiment": "a/b"})  # reaches Trackio with the next row
            await model.log(await gather(model, 10 + step), split="val")

    history = model.history()
    logs = SQLiteStorage.get_logs("tk", "first try")
    for split in ("train", "val"):
        logged = {r["step"]: r for r in logs if f"{split}/reward" in r}
        rows = history[history["split"] == split].set_index("step")
        assert sorted(logged) == list(rows.index) == ([0, 1] if split == "train" else [1, 2])
        for step, row in rows.iterrows():
            assert logged[step][f"{split}/reward"] == pytest.approx(row[f"{split}/reward"])
    assert any("train/loss" in r for r in logs)
    traces = SQLiteStorage.get_traces("tk", "first try")
    val = [t for t in traces if t["key"] == "val/trajectories" and t["step"] == 1]
    assert len(val) == 16  # two groups of 8, all logged
    assert val[0]["messages"][1] == {"role": "user", "content": "Which?"}
    assert {"split", "group", "index", "reward"} <= set(val[0]["metadata"])
    config = SQLiteStorage.get_run_config("tk", "first try")
    assert config["model"]["name"] == "agent" and config["experiment"] == "a/b"
    assert config["train_config"]["learning_rate"] == 0.01

    again = make()  # a restarted kernel: the same run goes on
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await again.register(backend)
        await again.train(await gather(again, 2), config=art.TrainConfig(learning_rate=1e-2))
    assert SQLiteStorage.get_runs("tk") == ["first try"]
    assert 2 in {r["step"] for r in SQLiteStorage.get_logs("tk", "first try") if "train/reward" in r}


async def test_report_metrics_names_only_what_exists(tmp_path):
    model = art.Model(name="m", project="p", report_metrics=["trackio", "tensorboard"])
    with pytest.warns(UserWarning, match="tensorboard.*'wandb' and 'trackio'"):
        await model.register(art.LocalBackend(path=tmp_path))
