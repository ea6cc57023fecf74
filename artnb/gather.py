"""`art.gather`: the pieces ART's `gather_trajectory_groups` is made of, for code that builds its own gather from them
(ART's tic-tac-toe self-play example groups each game's two players' trajectories by seat this way).

`art.gather_trajectory_groups` itself is artnb's (core/gather.py). These keep ART's calls: a `GatherContext` holds a
progress bar the caller makes, running means of reward and metrics and an exception budget; `set_gather_context`
makes it the current one for the awaitables created inside; `wrap_group_awaitable` awaits one rollout's result (a
group, or any sequence of trajectories), counts it on the bar, and tolerates a failure within `max_exceptions`
(returning None) or re-raises it.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Awaitable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .core.gather import gather_trajectories, gather_trajectory_groups
from .core.trajectory import Trajectory, TrajectoryGroup

__all__ = [
    "GatherContext",
    "gather_context_var",
    "gather_trajectories",
    "gather_trajectory_groups",
    "get_gather_context",
    "set_gather_context",
    "wrap_group_awaitable",
    "wrap_trajectories_awaitable",
]

_TOKEN_METRICS = ("prompt_tokens", "completion_tokens", "total_completion_tokens")  # shown last


@dataclass
class GatherContext:
    """A bar (`pbar`, a tqdm the caller makes; None: no bar) and what it shows: running means of each metric and
    the number of failed rollouts, which may not exceed `max_exceptions` (a count, or a fraction of the bar's
    total when below 1)."""

    pbar: Any = None
    metric_sums: dict[str, float] = field(default_factory=dict)
    metric_divisors: dict[str, int] = field(default_factory=dict)
    max_metrics: int | None = None
    pbar_total_completion_tokens: bool = (
        False  # accepted as in ART; the bar shows what trajectories' metrics hold
    )
    max_exceptions: int | float = 0
    increment_pbar: bool = True
    exceptions: int = 0

    def record(self, trajectory: Trajectory) -> None:
        """Add a finished trajectory's reward and numeric metrics to the running means."""
        for name, value in {"reward": trajectory.reward, **trajectory.metrics}.items():
            if isinstance(value, int | float) and math.isfinite(value):
                self.metric_sums[name] = self.metric_sums.get(name, 0.0) + float(value)
                self.metric_divisors[name] = self.metric_divisors.get(name, 0) + 1

    def update_pbar(self, n: int) -> None:
        """Move the bar by `n` and show the running means (token counts last) and the failures."""
        if self.pbar is None:
            return
        if self.increment_pbar:
            self.pbar.update(n)
        names = list(self.metric_sums)[: self.max_metrics]
        names.sort(key=lambda name: name in _TOKEN_METRICS)
        postfix = {name: self.metric_sums[name] / max(1, self.metric_divisors[name]) for name in names}
        if self.exceptions:
            postfix["exceptions"] = self.exceptions
        self.pbar.set_postfix(postfix)

    def too_many_exceptions(self) -> bool:
        allowed = self.max_exceptions
        if 0 < allowed < 1 and self.pbar is not None and self.pbar.total:
            return self.exceptions / self.pbar.total > allowed
        return self.exceptions > allowed

    def reset(self) -> None:
        self.pbar, self.exceptions, self.max_exceptions = None, 0, 0
        self.metric_sums, self.metric_divisors = {}, {}
        self.pbar_total_completion_tokens = False


gather_context_var: contextvars.ContextVar[GatherContext] = contextvars.ContextVar("artnb_gather_context")


@contextlib.contextmanager
def set_gather_context(context: GatherContext) -> Iterator[None]:
    """Make `context` the current one for this block, and for the tasks created inside it."""
    token = gather_context_var.set(context)
    try:
        yield
    finally:
        gather_context_var.reset(token)


def get_gather_context() -> GatherContext:
    """The current context; outside `set_gather_context`, a fresh one with no bar and no exception budget."""
    try:
        return gather_context_var.get()
    except LookupError:
        context = GatherContext()
        gather_context_var.set(context)
        return context


async def wrap_group_awaitable(awaitable: Awaitable[Any]) -> Any:
    """Await one rollout's result: a TrajectoryGroup or a sequence of trajectories (returned as it came). Its
    trajectories go into the current context's means and onto its bar; a failure is counted and, within the
    budget, gives None (else it is raised)."""
    result, error = await _counted(awaitable)
    if error is not None:
        return None
    trajectories = _record(_trajectories(result))
    get_gather_context().update_pbar(len(trajectories))
    return result


async def wrap_trajectories_awaitable(awaitable: Awaitable[Any]) -> Any:
    """Await one rollout's trajectory (or trajectories), counted as one on the bar; a failure within the budget
    is returned as the exception (else raised)."""
    result, error = await _counted(awaitable)
    if error is not None:
        return error
    trajectories = _record(_trajectories(result))
    get_gather_context().update_pbar(1)
    return result if isinstance(result, Trajectory) else trajectories


async def _counted(awaitable: Awaitable[Any]) -> tuple[Any, Exception | None]:
    """(result, None), or (None, the failure) for a failure within the current context's budget."""
    context = get_gather_context()
    try:
        return await awaitable, None
    except Exception as error:
        context.exceptions += 1
        context.update_pbar(0)
        if context.too_many_exceptions():
            raise
        return None, error


def _record(trajectories: list[Trajectory]) -> list[Trajectory]:
    context = get_gather_context()
    for trajectory in trajectories:
        context.record(trajectory)
    return trajectories


def _trajectories(result: Any) -> list[Trajectory]:
    if isinstance(result, Trajectory):
        return [result]
    if isinstance(result, TrajectoryGroup):
        return list(result.trajectories)
    if isinstance(result, Iterable) and not isinstance(result, str | bytes | dict):
        items = list(result)
        if all(isinstance(item, Trajectory) for item in items):
            return items
    raise TypeError(
        f"a rollout gave {type(result).__name__}; wrap_group_awaitable takes a TrajectoryGroup or a sequence of "
        "art.Trajectory"
    )
