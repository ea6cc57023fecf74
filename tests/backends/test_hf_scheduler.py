"""The HF engine's request scheduler (hf/scheduler.py), with a decoder that only records what it was given.

What a user relies on: an agent's next request joins the batch already decoding instead of waiting for it to
drain, yet a request for another adapter is not starved by a stream of newer ones; each request is answered as
soon as its own rows end.
"""

from __future__ import annotations

import asyncio
import time

from artnb.backends.engines.hf.batching import Row
from artnb.backends.engines.hf.scheduler import Scheduler


async def test_rows_join_a_running_batch_until_another_models_row_waits():
    """The scheduler's side of continuous batching, with a decoder that only records what it was given: rows of
    the running model join between steps; a queued row of another model stops the joining (the batch drains and
    that model runs next); a request is answered when its own rows end, not when its batch does."""
    batches: list[tuple[str, list[int]]] = []

    def run_batch(model, rows, more, on_finish):
        batches.append((model, [r.prompt_ids[0] for r in rows]))
        for _ in range(12):
            for row in more(8):
                batches[-1][1].append(row.prompt_ids[0])
                rows.append(row)
            for row in rows:  # a row ends the step after it came in
                if row.finish_reason is None and row.token_ids:
                    row.finish_reason = "length"
                    on_finish(row)
                row.token_ids.append(0)
            time.sleep(0.03)
        for row in rows:
            if row.finish_reason is None:
                row.finish_reason = "length"
                on_finish(row)

    scheduler = Scheduler(lambda name: name, run_batch, max_batch_size=8)
    scheduler.start()
    first = asyncio.create_task(scheduler.submit("a", [Row([1], max_tokens=1)]))
    while not batches:
        await asyncio.sleep(0.005)
    assert await scheduler.submit("a", [Row([2], max_tokens=1)]) == "a"  # joined, answered mid-batch
    assert scheduler.stats["running"] == 1 and len(batches) == 1  # its batch is still decoding
    other = asyncio.create_task(scheduler.submit("b", [Row([3], max_tokens=1)]))
    late = asyncio.create_task(scheduler.submit("a", [Row([4], max_tokens=1)]))
    assert await asyncio.gather(first, other, late) == ["a", "b", "a"]
    assert batches == [("a", [1, 2]), ("b", [3]), ("a", [4])]
    assert scheduler.stats["joined_rows"] == 1
