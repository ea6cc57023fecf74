"""kill -9 a training process at every phase of a step, resume in another process: nothing lost, nothing twice.

The child (trainer_process.py) SIGKILLs itself when the backend logs that it enters a phase; this process then
registers the same run, checks that step, history, rollouts and checkpoints agree, and trains the next step.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from trainer_process import GROUP_SIZE, GROUPS, gather

import artnb as art
from artnb import models
from artnb.backends.train_step import PHASES
from artnb.core.store import PENDING_ROLLOUTS, RunStore

CHILD = Path(__file__).with_name("trainer_process.py")
COMMITTED = ("publish", "hot-load", "release")  # a kill at these comes after the commit's rename
RECOVERED = ("rename", "publish")  # what the next register finds to undo (a temp dir) or finish (publication)


@pytest.fixture(scope="module")
def base() -> str:
    return models.tiny(hidden_size=64, num_layers=2, seed=1)


def assert_consistent(store: RunStore, step: int) -> None:
    """Checkpoints 0..step, one train history row and one batch of rollouts per trained step, no leftovers."""
    assert store.steps() == list(range(step + 1))
    history = store.history()
    train_steps = sorted(history[history["split"] == "train"]["step"]) if len(history) else []
    assert train_steps == list(range(step)), train_steps
    for s in range(step):
        groups = store.read_trajectories("train", s)
        assert sum(len(g) for g in groups) == GROUPS * GROUP_SIZE
        commit = store.read_commit(s + 1)
        assert commit.step == s and commit.id in set(history["commit"])
    written = sorted(int(p.stem) for p in store.trajectories_dir("train").glob("*.parquet"))
    assert written == list(range(step))
    assert not [p for p in store.checkpoints.iterdir() if p.name.startswith(".")]
    assert not list(store.checkpoints.glob(f"*/{PENDING_ROLLOUTS}"))


@pytest.mark.parametrize("phase", PHASES)
async def test_kill_at_each_phase_then_resume(tmp_path, base, phase):
    child = subprocess.run(
        [sys.executable, str(CHILD), str(tmp_path), base, f"kill:{phase}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr[-3000:]
    expected = 1 if phase in COMMITTED else 0

    model = art.TrainableModel(name="agent", project="p", base_model=base)
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            await model.register(backend)
        reports = [str(w.message) for w in caught if "left mid-step" in str(w.message)]
        assert len(reports) == (1 if phase in RECOVERED else 0), reports
        assert await model.get_step() == expected
        assert_consistent(model.store, expected)
        served = [m.id for m in (await model.openai_client().models.list()).data]
        assert f"agent@{expected}" in served

        result = await model.train(await gather(model, seed=2), learning_rate=1e-2)
        assert result.step == expected + 1
        assert_consistent(model.store, expected + 1)
