"""`art.trajectory_group_batches`: groups of rollouts, run concurrently, handed over in batches as they finish,
so a loop trains on one batch while the next ones are still rolling out.

    async for batch in art.trajectory_group_batches(
        (art.TrajectoryGroup(rollout(model, s) for _ in range(8)) for s in scenarios), batch_size=4
    ):
        await model.train(batch)

At most `batch_size * max_concurrent_batches` groups run at once (more start as batches are taken); batches hold
groups in the order they finished, and the last one may be smaller. Rollout failures inside a group are data (in
`group.exceptions`), as in `gather_trajectory_groups`; a group whose awaitable itself raises is left out, and
more than `max_batch_exceptions` such groups in one batch (a count, or a fraction of `batch_size` when below 1)
cancel the rest and raise. `groups` is consumed lazily, so an endless generator of scenarios works.
Unlike ART, the exception budget is per batch from the first batch on (ART's resets to 0 after the first).
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import math
import sys
from collections.abc import AsyncIterator, Awaitable, Iterable
from typing import Any

from .ignored import report_ignored
from .progress import RolloutProgress, TooManyExceptions, active_progress
from .trajectory import PendingGroup, TrajectoryGroup


async def trajectory_group_batches(
    groups: Iterable[Awaitable[TrajectoryGroup] | TrajectoryGroup],
    *,
    batch_size: int,
    max_batch_exceptions: int | float = 0,
    max_concurrent_batches: int = 4,
    skip_batches: int = 0,
    pbar_desc: str = "batches",
    pbar_total_completion_tokens: bool = False,
) -> AsyncIterator[list[TrajectoryGroup]]:
    """Yield lists of `batch_size` finished groups (see the module docstring)."""
    if batch_size < 1 or max_concurrent_batches < 1 or skip_batches < 0:
        raise ValueError("batch_size and max_concurrent_batches must be >= 1, skip_batches >= 0")
    if pbar_total_completion_tokens:
        report_ignored("trajectory_group_batches(pbar_total_completion_tokens=True)", "deprecated in ART too")
    allowed = (
        math.floor(max_batch_exceptions * batch_size)
        if isinstance(max_batch_exceptions, float) and 0 < max_batch_exceptions < 1
        else int(max_batch_exceptions)
    )
    items = iter(groups)
    for _ in range(batch_size * skip_batches):  # already trained (a resumed loop): never started
        if (skipped := next(items, None)) is None:
            break
        _discard(skipped)
    sized = len(groups) if hasattr(groups, "__len__") else None  # type: ignore[arg-type]
    progress = RolloutProgress(sized or 0, pbar_desc, sys.maxsize)  # counts rollouts, as a gather's bar
    if sized is None:
        progress.bar.total = None
    context = contextvars.copy_context()
    context.run(active_progress.set, progress)  # each group's rollouts report to this bar
    loop = asyncio.get_running_loop()
    running: set[asyncio.Task] = set()
    finished: list[TrajectoryGroup] = []
    failures, exhausted = 0, False
    try:
        while True:
            while not exhausted and len(running) < batch_size * max_concurrent_batches:
                item = next(items, None)
                if item is None:
                    exhausted = True
                    break
                running.add(context.run(loop.create_task, _finish(item)))  # create_task(context=) needs 3.11
            if not running:
                break
            done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if (error := task.exception()) is None:
                    finished.append(task.result())
                    continue
                failures += 1
                if failures > allowed:
                    raise TooManyExceptions(
                        f"{failures} groups of one batch failed, more than max_batch_exceptions="
                        f"{max_batch_exceptions}; the first failure follows"
                    ) from error
            while len(finished) >= batch_size:
                batch, finished = finished[:batch_size], finished[batch_size:]
                failures = 0
                yield batch
        if finished:
            yield finished
    finally:
        for task in running:
            task.cancel()
        if running:
            await asyncio.gather(*running, return_exceptions=True)
        progress.close()


async def _finish(item: Any) -> TrajectoryGroup:
    group = await item if inspect.isawaitable(item) else item
    if not isinstance(group, TrajectoryGroup):
        raise TypeError(
            f"trajectory_group_batches got {type(group).__name__}; pass art.TrajectoryGroup(...) items"
        )
    return group


def _discard(item: Any) -> None:
    """Close a skipped group's coroutines, so Python does not warn that they were never awaited."""
    for aw in item.awaitables if isinstance(item, PendingGroup) else [item]:
        if inspect.iscoroutine(aw):
            aw.close()
