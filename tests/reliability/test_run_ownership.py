"""Who may write a run, and what a cancelled or failed step leaves: two processes, two backends, two projects.

All with real processes, real engines on the tiny model, and real files.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import torch
from peft import get_peft_model_state_dict
from safetensors.torch import load_file
from trainer_process import gather

import artnb as art
from artnb import models

CHILD = Path(__file__).with_name("trainer_process.py")


@pytest.fixture(scope="module")
def base() -> str:
    return models.tiny(hidden_size=64, num_layers=2, seed=1)


def engine_children() -> set[int]:
    """Inference engine processes started by this process (alive)."""
    found = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        state = stat.rsplit(")", 1)[1].split()[0]
        if ppid == os.getpid() and state != "Z" and b"engines.hf.server" in cmdline:
            found.add(int(proc.name))
    return found


async def test_a_second_process_cannot_write_a_run_but_can_read_it(tmp_path, base):
    child = subprocess.Popen(
        [sys.executable, str(CHILD), str(tmp_path), base, "hold"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert (await asyncio.to_thread(child.stdout.readline)).strip() == "REGISTERED"
        model = art.TrainableModel(name="agent", project="p", base_model=base)
        before = engine_children()
        async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
            with pytest.raises(art.RunInUseError, match=rf"process {child.pid} on .*close that backend"):
                await model.register(backend)
            assert engine_children() == before  # refused before starting anything
            # reading needs no lock, and reads that run (not the default ./.art)
            assert model.store.dir == tmp_path / "p/models/agent" and model.history().empty
            plot = art.widgets.RewardPlot(model.store.dir)
            assert plot.store.dir == model.store.dir
        child.stdin.close()  # the child closes its backend and exits
        assert await asyncio.to_thread(child.wait, 60) == 0
        async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
            await model.register(backend)
            assert await model.get_step() == 0
            assert model.store.steps() == [0]
    finally:
        child.kill()
        child.wait()


async def test_a_second_backend_in_the_same_kernel_takes_over(tmp_path, base):
    model = art.TrainableModel(name="agent", project="p", base_model=base)
    first = art.LocalBackend(path=tmp_path, engine="hf")
    await model.register(first)
    old_engine = first.engine_of(model)
    old_client = model.openai_client()  # e.g. held by a rollout function defined in an earlier cell
    second = art.LocalBackend(path=tmp_path, engine="hf")  # a re-run notebook cell
    with pytest.warns(UserWarning, match="takes over"):
        await model.register(second)
    assert not old_engine.alive()
    with pytest.raises(RuntimeError, match="not registered on this backend"):
        first.engine_of(model)
    # the stale client is told why (it used to get "Connection error." after the SDK's retries)
    with pytest.raises(
        openai.NotFoundError, match="another LocalBackend registered the same run and took it"
    ):
        await old_client.chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": "Which?"}], max_tokens=2
        )
    groups = await gather(model, seed=1)
    assert (await model.train(groups, learning_rate=1e-2)).step == 1
    await second.close()


async def test_same_name_in_two_projects_are_two_runs(tmp_path, base):
    one = art.TrainableModel(name="agent", project="p1", base_model=base)
    two = art.TrainableModel(name="agent", project="p2", base_model=base)
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await one.register(backend)
        await two.register(backend)
        assert backend.engine_of(one) is not backend.engine_of(two)
        checkpoint = one.store.checkpoint_path(0) / "adapter_model.safetensors"
        untouched = checkpoint.read_bytes()
        result = await two.train(await gather(two, seed=1), learning_rate=1e-2)
        assert result.step == 1 and await two.get_step() == 1 and await one.get_step() == 0
        assert one.store.steps() == [0] and two.store.steps() == [0, 1]
        assert checkpoint.read_bytes() == untouched and one.history().empty
        served = {m.id for m in (await one.openai_client().models.list()).data}
        assert "agent@1" not in served and "agent@0" in served


class PauseAt(logging.Handler):
    """Blocks the event loop for a moment when the backend enters a phase, so a timeout expires right there."""

    def __init__(self, phase: str, seconds: float) -> None:
        super().__init__(logging.DEBUG)
        self.phase, self.seconds, self.paused = phase, seconds, False

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "artnb_phase", None) == self.phase:
            self.paused = True
            time.sleep(self.seconds)


class SeenPhase(logging.Handler):
    """Notes when the backend enters a phase (the step's log records name it), without slowing it."""

    def __init__(self, phase: str) -> None:
        super().__init__(logging.DEBUG)
        self.phase, self.seen = phase, False

    def emit(self, record: logging.LogRecord) -> None:
        self.seen = self.seen or getattr(record, "artnb_phase", None) == self.phase


def trainer_matches_checkpoint(backend: art.LocalBackend, model: art.TrainableModel) -> bool:
    saved = load_file(
        str(model.store.checkpoint_path(model.store.latest_step()) / "adapter_model.safetensors")
    )
    live = get_peft_model_state_dict(backend.trainer_of(model).model)
    return saved.keys() == live.keys() and all(torch.equal(saved[k], live[k].cpu()) for k in saved)


async def test_a_cancelled_train_commits_first_then_raises(tmp_path, base):
    model = art.TrainableModel(name="agent", project="p", base_model=base)
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        groups = await gather(model, seed=1)
        engine = backend.engine_of(model)
        logger = logging.getLogger("artnb")
        training = SeenPhase("train")  # the engine is held a moment before the trainer starts
        logger.addHandler(training)
        logger.setLevel(logging.DEBUG)
        try:
            task = asyncio.create_task(model.train(groups, learning_rate=1e-2))
            while not training.seen:
                await asyncio.sleep(0.01)
            task.cancel()
        finally:
            logger.removeHandler(training)
            logger.setLevel(logging.NOTSET)
        with pytest.warns(UserWarning, match="step 1 was committed first, so these groups are trained"):
            with pytest.raises(asyncio.CancelledError):
                await task
        # memory, disk and the served adapter agree on step 1
        assert await model.get_step() == 1 and model.store.steps() == [0, 1]
        assert list(model.history()["step"]) == [0]
        # ART's next call, logging the batch, adds to the step that trained it (no second row, no step 1 files)
        await model.log(groups, split="train", metrics={"after_interrupt": 1.0})
        history = model.history()
        assert list(history["step"]) == [0] and history.iloc[0]["train/after_interrupt"] == 1.0
        assert not (model.store.dir / "trajectories/train/0001.parquet").exists()
        assert trainer_matches_checkpoint(backend, model)
        reply = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert reply.model == "agent@1"

        # asyncio.wait_for whose timeout passes as the trainer starts: reported after the step committed. The
        # handler holds the loop past the timeout as the train phase begins; on a loaded machine the timeout can
        # pass before that (cancelled before training: nothing happens), so it grows until it lands there.
        groups = await gather(model, seed=2)
        for timeout in (0.2, 1.0, 5.0, 20.0):
            handler = PauseAt("train", seconds=timeout + 0.3)
            logger.addHandler(handler)
            logger.setLevel(logging.DEBUG)
            try:
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(model.train(groups, learning_rate=1e-2), timeout=timeout)
            finally:
                logger.removeHandler(handler)
                logger.setLevel(logging.NOTSET)
            if handler.paused:
                break
            assert await model.get_step() == 1 and list(model.history()["step"]) == [0]
            assert trainer_matches_checkpoint(backend, model)
        assert handler.paused and await model.get_step() == 2 and trainer_matches_checkpoint(backend, model)

        # cancelled while waiting for another step: it never runs
        batches = [await gather(model, seed=3), await gather(model, seed=4)]
        first = asyncio.create_task(model.train(batches[0], learning_rate=1e-2))
        while not (await engine.stats())["held"]:
            await asyncio.sleep(0.01)
        queued = asyncio.create_task(model.train(batches[1], learning_rate=1e-2))
        await asyncio.sleep(0.01)  # it waits for the running step
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert (await first).step == 3
        await asyncio.sleep(0.5)
        assert await model.get_step() == 3 and list(model.history()["step"]) == [0, 1, 2]
        assert not (await engine.stats())["held"]


async def test_a_failed_register_stops_its_engine_and_frees_the_run(tmp_path, base):
    model = art.TrainableModel(name="agent", project="p", base_model=base)
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
    before = engine_children()
    # Without model.json, register meets the other LoRA shape only when the trainer loads the checkpoint, after
    # the engine started (with it, register refuses before any start: test_local_backend.py).
    (tmp_path / "p/models/agent/model.json").unlink()
    other_shape = art.TrainableModel(name="agent", project="p", base_model=base, lora=art.LoRAConfig(r=4))
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        with pytest.raises(ValueError, match="use the same LoRAConfig to resume"):
            await other_shape.register(backend)
        assert engine_children() == before
        await model.register(backend)  # the lock was released
        assert await model.get_step() == 0


async def test_an_interrupted_register_stops_the_engine_it_was_starting(tmp_path, base):
    """The stop button pressed while the engine loads: no server is left running unowned (a re-run would
    start a second one), and registering again works."""
    model = art.TrainableModel(name="agent", project="p", base_model=base)
    before = engine_children()
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        task = asyncio.create_task(model.register(backend))
        while not engine_children() - before:  # the engine process is starting
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine_children() == before
        await model.register(backend)
        assert len(engine_children() - before) == 1 and await model.get_step() == 0
    assert engine_children() == before


async def test_the_engine_key_stays_out_of_reprs_and_files(tmp_path, base):
    model = art.TrainableModel(name="agent", project="p", base_model=base)
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        key = model.inference_api_key
        assert key and key not in repr(model) and key not in str(model)
        saved = (model.store.dir / "model.json").read_text()
        assert key not in saved and "inference_api_key" not in json.loads(saved)
        assert json.loads(saved)["base_model"] == base


async def test_a_failed_step_changes_nothing_and_its_retry_is_written_once(tmp_path, base):
    model = art.TrainableModel(name="agent", project="p", base_model=base)
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        groups = await gather(model, seed=1)
        engine = backend.engine_of(model)
        # short limits for this engine only (not its start, nor the engine the retry restarts), so that a loaded
        # machine's slow adapter load is not taken for the hang below
        engine.control_timeout_s = engine.hold_timeout_s = 2
        os.kill(engine.pid, signal.SIGSTOP)  # a hung engine: the hold before training times out
        try:
            with pytest.raises(TimeoutError, match="hold"):
                await model.train(groups, learning_rate=1e-2)
        finally:
            with contextlib.suppress(ProcessLookupError):  # a hung engine is stopped by the failed step
                os.kill(engine.pid, signal.SIGCONT)
        assert await model.get_step() == 0 and model.history().empty
        assert not model.store.trajectories_dir("train").exists()
        assert trainer_matches_checkpoint(backend, model)

        result = await model.train(groups, learning_rate=1e-2)  # the same batch again
        assert result.step == 1 and list(model.history()["step"]) == [0]
        assert sum(len(g) for g in model.store.read_trajectories("train", 0)) == len(groups) * len(groups[0])
