"""One writer per run directory, within this process as across processes.

Across processes the run's OS file lock (`RunStore.lock`) decides: a second kernel gets an error naming the holder.
Within one kernel, re-running a notebook's register cell with a new LocalBackend is normal, so the new backend
takes over: the old one is asked to let the run go (its engine stops) and a warning says so. This module keeps,
for each run directory this process writes, the function that lets it go.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from ..core.ignored import warn_user
from ..core.store import RunLock, RunStore

T = TypeVar("T")
# The holder's `release(project, name)`, a bound method of the backend that writes the run.
Release = Callable[[str, str], Awaitable[None]]
_HOLDERS: dict[Path, weakref.WeakMethod] = {}


def claim(store: RunStore, release: Release) -> RunLock:
    """Take the run's lock for the backend whose `release` lets it go again."""
    run_lock = store.lock()
    _HOLDERS[store.dir] = weakref.WeakMethod(release)  # type: ignore[arg-type]
    return run_lock


def disclaim(store: RunStore, release: Release, run_lock: RunLock) -> None:
    """Release the run's lock and forget the holder (unless another backend took the run over meanwhile)."""
    run_lock.release()
    ref = _HOLDERS.get(store.dir)
    if ref is None or ref() in (None, release):
        _HOLDERS.pop(store.dir, None)


async def take_over(store: RunStore, release: Release) -> None:
    """If another backend in this process writes `store`'s run, make it let the run go, with a warning."""
    ref = _HOLDERS.get(store.dir)
    other = ref() if ref is not None else None
    if other is None or other == release:
        return
    warn_user(
        f"artnb: {store.project}/{store.name} was registered on another LocalBackend in this kernel; that "
        "backend's engine for it is stopped and this backend takes over (one writer per run directory)."
    )
    await other(store.project, store.name)


async def as_writer(store: RunStore, release: Release, work: Callable[[], T]) -> T:
    """Run `work()` in a thread as the run's one writer (taking its lock for the time), for a run the backend
    does not train itself (S3 pulls, forks before register)."""
    await take_over(store, release)
    run_lock = store.lock()
    try:
        return await asyncio.to_thread(work)
    finally:
        run_lock.release()
