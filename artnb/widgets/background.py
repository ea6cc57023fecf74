"""Running a button's work as an asyncio task on the kernel's event loop, never blocking it.

A button handler must return at once: Jupyter delivers clicks on the kernel's event loop, and a handler that
awaited a training step there would freeze the kernel (no other cell, no widget update) until it ended. So
handlers only schedule a task. The loop is remembered when the panel is built (cells run inside it), so a
click delivered from another thread still lands on the loop that owns the model's HTTP clients and locks.
Failures are shown in the panel's Output widget, not lost in a task nobody awaits: the exception's message first
(the box is short), then the traceback.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import traceback
from collections.abc import Coroutine
from typing import Any

import ipywidgets as widgets


def current_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class Background:
    """At most one task at a time for a panel; errors go to `output`."""

    def __init__(self, output: widgets.Output) -> None:
        self.output = output
        self.loop = current_loop()
        self.task: asyncio.Future | concurrent.futures.Future | None = None

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def start(self, coro: Coroutine[Any, Any, Any]) -> bool:
        """Schedule `coro`; False (and nothing scheduled) if a task is still running."""
        if self.running:
            coro.close()
            return False
        here = current_loop()
        if here is not None and (self.loop is None or here is self.loop or not self.loop.is_running()):
            self.loop = here
            self.task = here.create_task(coro)
        elif self.loop is not None and self.loop.is_running():
            self.task = asyncio.run_coroutine_threadsafe(coro, self.loop)
        else:
            coro.close()
            raise RuntimeError(
                "no running asyncio event loop to run this on: use the panel in Jupyter (or Colab), or in a "
                "script call its loop directly, e.g. `await panel.loop.step()`"
            )
        self.task.add_done_callback(self._report)
        return True

    async def wait(self) -> None:
        """Wait for the running task (if any); its exception, if any, was already shown in `output`."""
        task = self.task
        if task is None:
            return
        if isinstance(task, concurrent.futures.Future):
            task = asyncio.wrap_future(task)
        await asyncio.wait([task])

    def _report(self, task: asyncio.Future | concurrent.futures.Future) -> None:
        if task.cancelled():
            self.output.append_stdout("cancelled\n")
            return
        exc = task.exception()
        if exc is not None:
            # what went wrong (and the hint, in artnb's errors) first: the box is short, the traceback long
            summary = "".join(traceback.format_exception_only(type(exc), exc))
            full = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            self.output.append_stderr(f"{summary}\n{full}")
