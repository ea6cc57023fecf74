"""Rollouts run concurrently under one progress bar and exception budget (gather.py and batches.py build on it).

Why a module of its own, below trajectory.py: awaiting a `TrajectoryGroup(coroutines)` runs its rollouts here,
under the bar of the enclosing `gather_trajectory_groups` when there is one. It knows rollouts only by what the
bar shows (a reward and metrics), so the trajectory types import it, not the other way round.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import math
import numbers
import sys
from collections.abc import Awaitable, Iterable, Mapping
from typing import Protocol, TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")


class Scored(Protocol):
    """What the bar reads of a finished rollout (a Trajectory)."""

    @property
    def reward(self) -> float: ...
    @property
    def metrics(self) -> Mapping[str, float | int | bool]: ...


class TooManyExceptions(RuntimeError):
    """More rollouts failed than `max_exceptions` allows; the first failure is chained as the cause."""


_MAX_EXCEPTIONS_FORMS = (
    "a count of failed rollouts (an int >= 0, e.g. 2; float('inf') tolerates all) or a fraction of all "
    "rollouts (a float between 0 and 1, e.g. 0.1)"
)


def check_max_exceptions(value: object, name: str = "max_exceptions") -> int | float:
    """`value` (as a Python int or float) if it is a failure budget as ART takes it; otherwise a TypeError or
    ValueError naming the accepted forms.

    Checked when a gather starts: the budget is only read at the first failed rollout, and an error raised
    there would cancel every rollout running and lose the finished ones. As in ART, a float below 1 is a
    fraction and anything else a count (so 1.0 means one failure).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {_MAX_EXCEPTIONS_FORMS} (got {value!r}); pass e.g. {name}=2")
    number = float(value)
    if math.isnan(number) or number < 0:
        raise ValueError(f"{name} must be {_MAX_EXCEPTIONS_FORMS} (got {value!r}); pass e.g. {name}=2")
    if number > 1 and not math.isinf(number) and not number.is_integer():
        raise ValueError(
            f"{name} above 1 is a count of failed rollouts, so it must be whole (got {value!r}); pass a count "
            f"such as {name}={math.floor(number)}, or a fraction of all rollouts below 1 such as {name}=0.1"
        )
    return int(value) if isinstance(value, numbers.Integral) else number


# the ART reading of 1.0, worth saying when someone meant "all of them"
_ONE_MEANS_ONE = " (1.0 is a count of one failure, as in ART; max_exceptions=float('inf') tolerates all)."


class RolloutProgress:
    """One bar and the exception budget shared by every rollout of a gather call."""

    def __init__(
        self, total: int, desc: str, max_exceptions: int | float, max_metrics: int | None = None
    ) -> None:
        self.max_exceptions = check_max_exceptions(
            max_exceptions
        )  # before the bar: a bad budget starts nothing
        self.bar = tqdm(total=total, desc=desc, dynamic_ncols=True)
        self.total = total
        self.max_metrics = max_metrics  # running means shown on the bar at most (reward first), None: all
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.exceptions = 0
        self.after_each_failures = 0

    def allowed_exceptions(self) -> int:
        """How many failed rollouts the budget tolerates: a fraction (below 1) of all rollouts, or a count."""
        m = self.max_exceptions
        if 0 < m < 1:
            return math.floor(m * max(self.total, 1))
        return sys.maxsize if math.isinf(m) else int(m)

    def add_trajectory(self, t: Scored, advance: int = 1) -> None:
        """Count `t` in the running means; move the bar by `advance` rollouts (0 for a rollout's later trajectories)."""
        for key, value in {"reward": t.reward, **t.metrics}.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.sums[key] = self.sums.get(key, 0.0) + float(value)
                self.counts[key] = self.counts.get(key, 0) + 1
        self._refresh(advance)

    def add_exception(self, exc: BaseException) -> None:
        self.exceptions += 1
        self._refresh()
        if self.exceptions > self.allowed_exceptions():
            raise TooManyExceptions(
                f"{self.exceptions} rollouts failed, more than max_exceptions={self.max_exceptions}; "
                f"the first failure follows. Raise max_exceptions (a count or a fraction) to tolerate failures"
                f"{_ONE_MEANS_ONE if self._one_meant_as_all() else '.'}"
            ) from exc

    def _one_meant_as_all(self) -> bool:
        """max_exceptions=1.0: ART reads it as one failure; whoever wrote it may have meant 100%."""
        return isinstance(self.max_exceptions, float) and self.max_exceptions == 1

    def add_after_each_failure(self) -> None:
        self.after_each_failures += 1
        self._refresh(advance=0)

    def _refresh(self, advance: int = 1) -> None:
        keys = sorted(self.sums, key=lambda k: k != "reward")[: self.max_metrics]
        postfix = {k: f"{self.sums[k] / self.counts[k]:.3g}" for k in keys}
        if self.exceptions:
            postfix["exceptions"] = str(self.exceptions)
        if self.after_each_failures:
            postfix["after_each_errors"] = str(self.after_each_failures)
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(advance)

    def close(self) -> None:
        self.bar.close()


# the bar of the enclosing gather (or batches) call, which each awaited group's rollouts report to
active_progress: contextvars.ContextVar[RolloutProgress | None] = contextvars.ContextVar(
    "artnb_gather_progress", default=None
)


async def all_or_cancel(aws: Iterable[Awaitable[T]]) -> list[T]:
    """asyncio.gather that cancels the siblings when one fails (so a failed gather stops spending tokens)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


S = TypeVar("S", bound=Scored)


async def _one(aw: Awaitable[S] | S, expected: type[S], progress: RolloutProgress) -> S | BaseException:
    try:
        result = await aw if inspect.isawaitable(aw) else aw
        if not isinstance(result, expected):
            raise TypeError(
                f"a rollout returned {type(result).__name__}; rollouts must return an art.Trajectory. A rollout "
                "that returns its reward, its chat calls captured, goes in as art.trajectory(rollout(...)), or "
                "its group as art.trajectory_group(...)"
            )
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # a failed rollout is data, kept in group.exceptions
        progress.add_exception(exc)
        return exc
    progress.add_trajectory(result)
    return result


async def run_rollouts(awaitables: Iterable[Awaitable[S] | S], expected: type[S]) -> list[S | BaseException]:
    """Run one group's rollouts (each must give an `expected`, a Trajectory); a failed one is returned in its
    place. Uses the enclosing gather's bar, or its own when awaited alone."""
    awaitables = list(awaitables)
    enclosing = active_progress.get()
    progress = enclosing if enclosing is not None else RolloutProgress(len(awaitables), "group", 0)
    try:
        return await all_or_cancel(_one(aw, expected, progress) for aw in awaitables)
    finally:
        if enclosing is None:
            progress.close()
