"""A run directory on a disk that fills up: a real tmpfs of a few megabytes, the tiny model on the HF engine.

Training until the disk is full must stop with a clear error at the first write that fails, leave the last
committed step intact and readable, and resume once space is freed: no torn history line, no half checkpoint
counted as a step, every committed step recorded once. Mounting a tmpfs needs root; elsewhere the test skips.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from tiny_loop import gather

import artnb as art
from artnb.core.atomic import append_line

CONFIG = art.TrainConfig(learning_rate=1e-2)


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip() or done.returncode})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk, leave: int) -> None:
    """A ballast file that leaves about `leave` bytes free."""
    stats = os.statvfs(disk)
    with open(disk / "ballast", "wb") as f:
        f.write(b"\0" * max(0, stats.f_bavail * stats.f_frsize - leave))


async def test_training_until_the_disk_is_full_stops_cleanly_and_resumes(small_disk):
    model = art.TrainableModel(name="agent", project="disk", base_model=art.models.tiny())
    async with art.LocalBackend(path=small_disk / "art", engine="hf") as backend:
        await model.register(backend)
        fill(small_disk, leave=200_000)  # room for a step or two of the tiny model, not for ten
        committed = []
        with pytest.raises(art.DiskFullError) as full:
            for step in range(10):
                committed.append((await model.train(await gather(model, step), config=CONFIG)).step)
        message = str(full.value)
        assert f"step {len(committed)} was not committed" in message and "Free some space" in message
        assert await model.get_step() == len(committed)
        history = model.history()  # readable, one row per committed step
        assert list(history["step"]) == list(range(len(committed)))
        checkpoints = small_disk / "art" / "disk" / "models" / "agent" / "checkpoints"
        assert sorted(p.name for p in checkpoints.iterdir()) == [
            f"{i:04d}" for i in range(len(committed) + 1)
        ]
        (small_disk / "ballast").unlink()
        result = await model.train(await gather(model, len(committed)), config=CONFIG)
        assert result.step == len(committed) + 1
    rows = (small_disk / "art" / "disk" / "models" / "agent" / "history.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == list(
        range(len(committed) + 1)
    )  # no torn line, none twice


def test_a_history_line_that_does_not_fit_leaves_the_file_as_it_was(small_disk):
    history = small_disk / "history.jsonl"
    append_line(history, json.dumps({"step": 0}))
    fill(small_disk, leave=0)
    before = history.read_bytes()
    with pytest.raises(OSError) as full:
        append_line(history, json.dumps({"step": 1, "pad": "x" * 100_000}))
    assert full.value.errno == 28  # ENOSPC
    assert history.read_bytes() == before
