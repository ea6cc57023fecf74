"""A decorator that caps how many calls of an async function run at once, overall or per key.

Rollouts fan out (groups x trajectories x turns), and a tool server, a judge API or a small local engine
falls over long before the event loop does. `@limit_concurrency(8)` makes the 9th concurrent call wait for a
free slot; `derive_key` gives each key (a host, a model name) its own 8 slots.

Same call shape as OpenPipe ART's `art.utils.limit_concurrency(n, derive_key=None)`. Departures:
- Slots are kept per event loop as well as per key. ART keeps one `asyncio.Semaphore` per key for the life of
  the decorator, and a semaphore used under contention is bound to its loop, so a decorated function called
  from a second `asyncio.run(...)` (a script, a test) raises "bound to a different event loop".
- `n` is checked when decorating, and a decorated function that returns something not awaitable raises a
  TypeError that says so instead of failing inside `await`.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import weakref
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def limit_concurrency(n: int, derive_key: Callable[..., Hashable] | None = None) -> Callable[[F], F]:
    """Decorate an async function so at most `n` calls per key run concurrently (one key if no `derive_key`).

    `derive_key` receives the call's arguments and returns a hashable key.

    >>> @limit_concurrency(4, derive_key=lambda server, *args, **kwargs: server)
    ... async def call_tool(server: str, name: str, arguments: dict) -> str: ...
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(
            f"limit_concurrency(n={n!r}): n is the number of concurrent calls allowed, an int >= 1"
        )
    if derive_key is not None and not callable(derive_key):
        raise TypeError(
            f"derive_key must be a function of the call's arguments that returns a key, got {derive_key!r}"
        )
    slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Hashable, asyncio.Semaphore]] = (
        weakref.WeakKeyDictionary()
    )

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        async def limited(*args: Any, **kwargs: Any) -> Any:
            key = derive_key(*args, **kwargs) if derive_key is not None else None
            per_key = slots.setdefault(asyncio.get_running_loop(), {})
            semaphore = per_key.get(key)
            if semaphore is None:
                semaphore = per_key[key] = asyncio.Semaphore(n)
            async with semaphore:
                result = fn(*args, **kwargs)
                if not inspect.isawaitable(result):
                    raise TypeError(
                        f"limit_concurrency wraps async functions, but {getattr(fn, '__qualname__', fn)!r} "
                        f"returned {type(result).__name__}; define it with `async def`"
                    )
                return await result

        return limited  # type: ignore[return-value]

    return decorate
