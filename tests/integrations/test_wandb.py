"""W&B reporting with the real `wandb` library in offline mode: the run's transaction log (`run-<id>.wandb`,
LevelDB-style records of W&B's protobuf `Record`s) is read back and compared with the model's history; a
resumed run keeps its id; without W&B asked for, wandb is not imported; an unreachable W&B never stops training."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_loop import gather

import artnb as art
from artnb.integrations import wandb_run
from artnb.models import tiny

BASE = tiny(hidden_size=64, num_layers=2, seed=1)


def records(path: Path):
    """W&B's records from a `.wandb` file: a 7-byte header, then 32 KiB blocks of (crc, length, type) chunks."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, payload = 7, 32768, b""
    while pos + 7 <= len(data):
        if (left := block - pos % block) < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        payload = chunk if kind in (1, 2) else payload + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(payload)
            yield record


def offline_runs(run_dir: Path, wait_s: float = 60) -> list[dict]:
    """Each offline run under the run directory: its id, history rows, config and summary, oldest first. W&B's
    service process writes a run's file after `run.finish()` returns (a clean run once read one with only its
    header): wait, up to `wait_s`, until every file has its closing `exit` record."""
    deadline = time.monotonic() + wait_s
    while True:
        runs = _read_offline_runs(run_dir)
        if all(run["exited"] for run in runs) or time.monotonic() > deadline:
            return runs
        time.sleep(0.2)


def _read_offline_runs(run_dir: Path) -> list[dict]:
    out = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        run = {"id": None, "history": [], "config": {}, "summary": {}, "dir": path.parent, "exited": False}
        try:
            found = list(records(path))
        except Exception:  # a record cut short: the file is still being written
            found = []
        for record in found:
            kind = record.WhichOneof("record_type")
            if kind == "exit":
                run["exited"] = True
            elif kind == "run":
                run["id"] = record.run.run_id
                run["config"].update({u.key: json.loads(u.value_json) for u in record.run.config.update})
            elif kind == "config":
                run["config"].update({u.key: json.loads(u.value_json) for u in record.config.update})
            elif kind == "summary":
                run["summary"].update(
                    {u.key: json.loads(u.value_json) for u in record.summary.update if u.key}
                )
            elif kind == "history":
                run["history"].append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                )
        out.append(run)
    return out


@pytest.fixture(autouse=True)
def fresh_wandb():
    """wandb keeps process-wide settings from its first use (e.g. the mode); each test starts from its env."""
    import wandb

    wandb.teardown()
    yield
    wandb.teardown()


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


async def test_a_run_records_history_config_and_trajectories_and_resumes(offline, tmp_path):
    model = art.TrainableModel(name="agent 1", project="wb", base_model=BASE, report_metrics=["wandb"])
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        for step in range(3):
            await model.train(await gather(model, step), config=art.TrainConfig(learning_rate=1e-2))
            await model.log(await gather(model, 10 + step), split="val")
        model.update_wandb_config({"experiment": "a/b"})
    [run] = offline_runs(model.store.dir)
    assert run["id"] == wandb_run.run_id(model) and run["id"].startswith("wb-agent_1-")  # stable, W&B-safe

    history = model.history()
    for split in ("train", "val"):
        logged = {r["training_step"]: r for r in run["history"] if f"{split}/reward" in r}
        rows = history[history["split"] == split].set_index("step")
        assert sorted(logged) == list(rows.index) == ([0, 1, 2] if split == "train" else [1, 2, 3])
        for step, row in rows.iterrows():
            assert logged[step][f"{split}/reward"] == pytest.approx(row[f"{split}/reward"])
            assert logged[step][f"{split}/trajectories/nrows"] == 16  # the sampled table: all 16 here
    assert any(r.get("train/loss") is not None for r in run["history"])
    assert (
        run["config"]["model"]["name"] == "agent 1" and run["config"]["train_config"]["learning_rate"] == 0.01
    )
    assert run["config"]["experiment"] == "a/b"
    assert run["summary"]["checkpoint"] == str(model.store.checkpoint_path(3))
    table = json.loads(next(run["dir"].glob("files/media/table/train/trajectories_*.table.json")).read_text())
    assert table["columns"] == ["step", "split", "group", "index", "reward", "metrics", "messages"]
    assert "user: Which?" in table["data"][0][6]

    # a restarted kernel: a new model object and backend on the same run directory resume the same W&B run
    again = art.TrainableModel(name="agent 1", project="wb", base_model=BASE, report_metrics=["wandb"])
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await again.register(backend)
        await again.train(await gather(again, 3), config=art.TrainConfig(learning_rate=1e-2))
    first, resumed = offline_runs(model.store.dir)
    assert resumed["id"] == first["id"]
    assert [r["training_step"] for r in resumed["history"]] == [3]


def in_a_fresh_process(code: str, tmp_path: Path, **env: str) -> str:
    """The first line `code` prints, run in a new Python with `m`, a model in tmp_path, and no W&B or Langfuse
    variables but `env`."""
    setup = f"import sys, artnb as art; m = art.TrainableModel(name='a', project='p', base_model='x', base_path={str(tmp_path)!r}); "
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "LANGFUSE_"))}
    out = subprocess.run(
        [sys.executable, "-c", setup + code],
        capture_output=True,
        text=True,
        env={**clean, **env},
        timeout=180,
    )
    return (out.stdout.strip().splitlines() or [""])[0] + ("" if out.returncode == 0 else out.stderr[-2000:])


def test_without_wandb_asked_for_it_is_not_imported(tmp_path):
    code = (
        "assert m.reporting.reporters() == [], m.reporting.reporters(); "
        "print('wandb imported' if 'wandb' in sys.modules else 'ok')"
    )
    assert in_a_fresh_process(code, tmp_path) == "ok"


def test_a_run_that_starts_weave_leaves_openai_nothing_half_imported(tmp_path):
    """ART's notebooks import weave; wandb.init then starts Weave in the W&B thread, and Weave imports httpx2 there
    while rollouts parse responses in the notebook's thread. openai reads `sys.modules["httpx2"]` on every response,
    so httpx2 must be whole from the moment the run starts (a half-imported one once failed a rollout in CI). A
    fresh process, so nothing imported httpx2 before."""
    code = (
        "import weave; from artnb.integrations import wandb_run; "
        "r = wandb_run.WandbReporter(m); h = sys.modules.get('httpx2'); "
        "print('whole' if h is not None and hasattr(h, 'Response') else 'missing or partial'); r.close()"
    )
    assert in_a_fresh_process(code, tmp_path, WANDB_MODE="offline") == "whole"


def test_an_offline_run_with_weave_imported_asks_for_no_login(tmp_path):
    """Offline, wandb.init would start Weave (imported, as ART's notebooks do), which needs the W&B server: it asked
    for an API key on stdin from the W&B thread and then tried to reach wandb.ai. The run records without it."""
    setup = f"import artnb as art; m = art.TrainableModel(name='a', project='p', base_model='x', base_path={str(tmp_path)!r}); "
    code = "import weave; from artnb.integrations import wandb_run; r = wandb_run.WandbReporter(m); r.close()"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "LANGFUSE_"))}
    out = subprocess.run(
        [sys.executable, "-c", setup + code],
        capture_output=True,
        text=True,
        env={**clean, "WANDB_MODE": "offline"},
        timeout=180,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "API key" not in out.stdout + out.stderr and "initialize weave" not in out.stdout + out.stderr
    model = art.TrainableModel(name="a", project="p", base_model="x", base_path=str(tmp_path))
    [run] = offline_runs(model.store.dir)
    assert run["id"] == wandb_run.run_id(model)


async def test_an_unreachable_wandb_warns_once_and_training_goes_on(monkeypatch, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{closed}")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "5")
    model = art.TrainableModel(name="agent", project="wb-down", base_model=BASE)  # on: WANDB_API_KEY is set
    with pytest.warns(UserWarning, match="W&B stopped recording") as caught:
        async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
            await model.register(backend)
            started = time.monotonic()
            for step in range(2):
                await model.train(await gather(model, step), config=art.TrainConfig(learning_rate=1e-2))
            took = time.monotonic() - started
    assert model.store.latest_step() == 2
    assert took < 30  # the loop never waited on W&B
    assert sum("W&B" in str(w.message) for w in caught) == 1
