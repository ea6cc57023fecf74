"""A disk that reports an I/O error where a step's checkpoint is made durable: after the rename (the commit point),
when the checkpoints directory is fsynced. The step is then on disk and counts; the run must go on from it.

The error is injected at the system call (`os.fsync` answers EIO for the checkpoints directory, once): a real
failing disk needs a device-mapper target, which a test machine does not have.
"""

from __future__ import annotations

import errno
import os

import pytest
from tiny_loop import gather

import artnb as art

CONFIG = art.TrainConfig(learning_rate=1e-2)


def fail_once_on(directory, monkeypatch) -> list[str]:
    """`os.fsync` of `directory` raises EIO the first time; returns the list it records the failure in."""
    real_fsync, failed = os.fsync, []

    def fsync(fd: int) -> None:
        if not failed and os.readlink(f"/proc/self/fd/{fd}") == str(directory):
            failed.append(str(directory))
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return failed


async def test_an_fsync_error_after_the_rename_leaves_the_step_committed(tmp_path, monkeypatch):
    model = art.TrainableModel(name="agent", project="disk", base_model=art.models.tiny())
    run = tmp_path / "art" / "disk" / "models" / "agent"
    async with art.LocalBackend(path=tmp_path / "art", engine="hf") as backend:
        await model.register(backend)
        first = await model.train(await gather(model, 0), config=CONFIG)
        failed = fail_once_on(run / "checkpoints", monkeypatch)
        with pytest.warns(UserWarning, match=r"step 1 is committed .*Input/output error.*goes on at step 2"):
            second = await model.train(await gather(model, 1), config=CONFIG)
        assert failed, "the injected error was not reached: the test no longer covers the commit's fsync"
        assert (first.step, second.step) == (1, 2)
        assert await model.get_step() == 2
        # before: FileExistsError, checkpoint 0002 being on disk while the backend was at step 1
        third = await model.train(await gather(model, 2), config=CONFIG)
        assert third.step == 3
        assert list(model.history()["step"]) == [0, 1, 2]
        assert await model.get_step() == 3
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["0000", "0001", "0002", "0003"]
