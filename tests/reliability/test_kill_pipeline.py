"""kill -9 a PipelineTrainer while rollouts are in flight between two steps, then resume in this process: the
committed steps are all there, the run goes on from the last commit, and no scenario is lost or trained twice."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from pipeline_process import SETTINGS
from tiny_loop import scenario_group

import artnb as art
from artnb import models
from artnb.pipeline_trainer import PipelineTrainer

CHILD = Path(__file__).with_name("pipeline_process.py")


def saved_step(state_path: Path) -> int:
    try:
        return json.loads(state_path.read_text())["_pipeline_trainer"]["step"]
    except (OSError, ValueError, KeyError):
        return -1


async def test_a_kill_between_steps_loses_nothing_and_resumes(tmp_path):
    base = models.tiny(hidden_size=64, num_layers=2, seed=1)
    model = art.TrainableModel(name="agent", project="p", base_model=base, base_path=str(tmp_path))
    child = subprocess.Popen(
        [sys.executable, str(CHILD), str(tmp_path), base], stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 240
        while saved_step(model.store.state_path) < 2:
            assert child.poll() is None, child.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the pipeline did not reach step 2"
            time.sleep(0.05)
    finally:
        child.kill()  # SIGKILL: no cleanup; rollouts for the next step are in flight
        child.wait()
    position = json.loads(model.store.state_path.read_text())["_pipeline_trainer"]
    killed_at = position["step"]

    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        assert await model.get_step() == killed_at  # nothing after the saved position had committed
        summary = await PipelineTrainer(
            model,
            backend,
            scenario_group,
            range(1000),
            {"delay": 0.5},
            max_steps=2,
            learning_rate=1e-2,
            **SETTINGS,
        ).train()
    final = killed_at + 2
    assert summary.final_step == final and model.store.steps() == list(range(final + 1))
    history = model.history()
    assert sorted(history[history["split"] == "train"]["step"]) == list(range(final))
    trained = [
        t.metadata["scenario"]
        for s in range(final)
        for g in model.store.read_trajectories("train", s)
        for t in g
    ]
    per_scenario = {s: trained.count(s) for s in set(trained)}
    assert set(per_scenario.values()) == {4}, per_scenario  # each trained scenario once (a group of 4)
    # scenarios the first process had not finished were rolled out by the second: none skipped
    resumed = {
        t.metadata["scenario"]
        for s in range(killed_at, final)
        for g in model.store.read_trajectories("train", s)
        for t in g
    }
    unfinished = set(range(position["scenario_offset"], max(trained) + 1)) - set(
        position["finished_after_offset"]
    )
    assert min(unfinished) in resumed or summary.stale_groups_discarded > 0  # (or dropped as too stale)
