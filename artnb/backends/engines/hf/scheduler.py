"""The HF engine's request scheduler: queues requests, forms batches, and hands rows to a running batch.

Why apart from the decoding loop (hf/batching.py): it lives on the event loop and knows requests, model names
and hold/release, while the loop lives on a worker thread and knows rows and tensors; the two meet at
`run_batch(name, rows, more, on_finish)` and the queue's lock. Design choices:

- Requests that arrive within a few milliseconds of each other form one batch (`quiet_s`, `max_wait_s`).
- One model's rows per batch; names resolve when rows are scheduled, so a request queued during `hold` runs on
  the adapter loaded before `release` (no row joins a batch while held).
- Queued rows of the running model join it between steps; joining stops at the first queued row of another
  model, so that model runs next instead of waiting behind a stream of newer rows.
- A request is answered as soon as its own rows end; a cancelled one drops its queued rows and its running
  rows leave at the next step.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from artnb.backends.engines.hf.batching import Row


@dataclass
class _Job:
    model: str
    rows: list[Row]
    future: asyncio.Future
    resolved: str | None = None  # the model name the rows ran on, fixed when the first rows are scheduled


class Scheduler:
    """Queues requests, batches them, and runs each batch in a worker thread; supports hold/release.

    `resolve(name)` maps a requested model name to the name that serves it (raising for unknown names);
    `run_batch(resolved_name, rows, more, on_finish)` decodes the rows (blocking; it runs in a worker thread),
    calling `more(n)` between steps for up to n queued rows of the same model to join the running batch, and
    `on_finish(row)` as each row ends, so that a request is answered as soon as its own rows are done.
    """

    def __init__(
        self,
        resolve: Callable[[str], str],
        run_batch: Callable[[str, list[Row], Callable[[int], list[Row]], Callable[[Row], None]], None],
        max_batch_size: int,
        quiet_s: float = 0.01,  # a batch forms once no request arrived for this long...
        max_wait_s: float = 0.05,  # ...or after this long, whichever comes first
    ):
        self.resolve, self.run_batch, self.max_batch_size = resolve, run_batch, max_batch_size
        self.quiet_s, self.max_wait_s = quiet_s, max_wait_s
        self._pending: deque[Row] = deque()
        self._lock = threading.Lock()  # _pending is also read by the decoding thread (rows joining)
        self._arrivals = 0
        self._work = asyncio.Event()
        self._released = asyncio.Event()
        self._released.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stats = {
            "requests": 0,
            "rows": 0,  # rows decoded (aborted ones included)
            "batches": 0,
            "joined_rows": 0,  # rows that joined a batch already decoding
            "running": 0,
            "held": False,
            "aborted_rows": 0,  # left a running batch because their client disconnected
            "dropped_rows": 0,  # removed from the queue before running, because their client disconnected
        }
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._loop_forever())

    async def submit(self, model: str, rows: list[Row]) -> str:
        """Queue rows for `model`; return the model name they ran on once all are finished.

        Cancelling the caller (its client went away) cancels the rows: queued ones are dropped, running ones
        leave their batch at the next decoding step.
        """
        job = _Job(model, rows, asyncio.get_running_loop().create_future())
        for row in rows:
            row.job = job
        with self._lock:
            self._pending.extend(rows)
        self._arrivals += 1
        self.stats["requests"] += 1
        self._work.set()
        try:
            return await job.future
        except asyncio.CancelledError:
            for row in rows:
                row.cancelled = True
            raise

    async def hold(self) -> None:
        """New and queued requests wait; returns once the batch in flight (if any) has finished."""
        self.stats["held"] = True
        self._released.clear()
        await self._idle.wait()

    def release(self) -> None:
        self.stats["held"] = False
        self._released.set()

    async def _gather(self) -> None:
        deadline = time.monotonic() + self.max_wait_s
        while len(self._pending) < self.max_batch_size and time.monotonic() < deadline:
            seen = self._arrivals
            await asyncio.sleep(self.quiet_s)
            if self._arrivals == seen:
                return

    def _pick(self, model: str | None, limit: int) -> tuple[str, list[Row]]:
        """Up to `limit` queued rows of `model` (None: the oldest live row's model); fails unknown models.

        Runs on the event loop (a new batch) or the decoding thread (rows joining), under the queue's lock.
        Joining stops at the first queued row of another model, so that the batch drains and that model's rows
        run next instead of waiting behind a stream of newer rows.
        """
        chosen = model
        batch: list[Row] = []
        remaining: deque[Row] = deque()
        blocked = False
        with self._lock:
            for row in self._pending:
                job = row.job
                if row.cancelled:
                    self.stats["dropped_rows"] += 1
                    continue
                if job.future.done():
                    continue
                try:
                    name = job.resolved or self.resolve(job.model)
                except Exception as error:
                    self._call(_fail, job, error)
                    continue
                chosen = chosen or name
                blocked = blocked or (model is not None and name != model)
                if name == chosen and len(batch) < limit and not blocked:
                    job.resolved = name
                    batch.append(row)
                else:
                    remaining.append(row)
            self._pending = remaining
        return chosen or "", batch

    def _join(self, model: str, batch: list[Row], limit: int) -> list[Row]:
        """Rows to join the running batch of `model` (the decoding thread asks between steps)."""
        if not self._pending or not self._released.is_set():
            return []
        _, rows = self._pick(model, limit)
        batch += rows
        self.stats["joined_rows"] += len(rows)
        return rows

    def _finished(self, row: Row) -> None:
        """A row ended (on the decoding thread): answer its request if that was its last row."""
        job = row.job
        if job is not None and all(r.finish_reason for r in job.rows):
            self._call(_complete, job)

    def _call(self, function: Callable[..., None], *args: Any) -> None:
        """Run `function` on the event loop (futures are not thread-safe), from either thread."""
        assert self._loop is not None, "Scheduler.start() first"
        self._loop.call_soon_threadsafe(function, *args)

    async def _loop_forever(self) -> None:
        while True:
            await self._work.wait()
            await self._released.wait()
            await self._gather()
            if not self._released.is_set():
                continue
            model, batch = self._pick(None, self.max_batch_size)
            if not self._pending:
                self._work.clear()
            if not batch:
                continue
            self._idle.clear()
            self.stats["running"] = 1
            more = partial(self._join, model, batch)
            try:
                await asyncio.to_thread(self.run_batch, model, batch, more, self._finished)
            except Exception as error:
                for job in {id(r.job): r.job for r in batch}.values():
                    _fail(job, error)
            finally:
                self.stats["running"] = 0
                self.stats["batches"] += 1
                self.stats["rows"] += len(batch)
                self.stats["aborted_rows"] += sum(r.finish_reason == "abort" for r in batch)
                self._idle.set()
            for job in {id(r.job): r.job for r in batch}.values():
                if all(r.finish_reason for r in job.rows):
                    _complete(job)
            if self._pending:
                self._work.set()


def _complete(job: _Job) -> None:
    if not job.future.done():
        job.future.set_result(job.resolved)


def _fail(job: _Job, error: BaseException) -> None:
    if not job.future.done():
        job.future.set_exception(error)
