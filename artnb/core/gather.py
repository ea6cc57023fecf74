"""Running rollouts concurrently: groups of trajectories under one progress bar, with tolerated failures.

`gather_trajectory_groups` awaits every group at once, shows one tqdm.auto bar over all trajectories with
running means of reward and metrics, keeps failed rollouts in `group.exceptions` up to `max_exceptions`, and
passes each finished group through `after_each` (where RULER scoring plugs in). `retry` wraps a flaky call.

Why `after_each` failures are handled per group: `after_each` usually calls a remote judge, which fails now and
then (rate limits, a restart). One such failure must not cancel the other groups' rollouts and throw away every
finished group, so by default (`after_each_errors="drop"`) the group is left out, the failure is logged, shown
on the bar and listed in the result's `after_each_failures`, and the rest go on. "keep" returns the group as it
was before `after_each`, marked with `metrics["after_each_error"] = 1`; "raise" stops the whole gather.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Literal

from pydantic import BaseModel

from .ignored import report_ignored
from .progress import (
    RolloutProgress,
    TooManyExceptions,
    active_progress,
    all_or_cancel,
    check_max_exceptions,
)
from .trajectory import ExceptionRecord, PendingGroup, Trajectory, TrajectoryGroup

log = logging.getLogger("artnb")
AfterEach = Callable[[TrajectoryGroup], Any]
AfterEachErrors = Literal["drop", "keep", "raise"]
AFTER_EACH_ERROR_METRIC = "after_each_error"  # group.metrics key of a group kept unprocessed ("keep")
_ON_FAILURE = {"drop": "leaving it out", "keep": "keeping it as it was", "raise": "stopping the gather"}


class AfterEachFailure(BaseModel):
    """`after_each` raised on the group at `group_index`, its position among the groups given to the gather."""

    group_index: int
    error: ExceptionRecord


class GatheredGroups(list[TrajectoryGroup]):
    """The finished groups as a plain list, plus `after_each_failures`: the groups `after_each` failed on."""

    def __init__(
        self, groups: Iterable[TrajectoryGroup] = (), after_each_failures: Iterable[AfterEachFailure] = ()
    ) -> None:
        super().__init__(groups)
        self.after_each_failures = list(after_each_failures)


def _as_groups(out: Any) -> list[TrajectoryGroup]:
    """What `after_each` returned, as a list of groups; else a TypeError, handled as an after_each failure."""
    if out is None:
        return []
    if isinstance(out, TrajectoryGroup):
        return [out]
    fix = "return a TrajectoryGroup, None (to drop the group) or a list of TrajectoryGroups"
    if isinstance(out, list):
        for i, g in enumerate(out):
            if not isinstance(g, TrajectoryGroup):
                raise TypeError(
                    f"after_each returned a list whose item {i} is {type(g).__name__} (got {g!r:.80}); {fix}"
                )
        return out
    raise TypeError(f"after_each returned {type(out).__name__} (got {out!r:.80}); {fix}")


def _check_after_each(after_each: object) -> None:
    """Refuse a non-callable `after_each` before any rollout runs: called on each finished group, it would fail
    on every one of them, after all the rollouts were paid for."""
    if after_each is not None and not callable(after_each):
        raise TypeError(
            f"after_each must be a function called with each finished group (got {type(after_each).__name__} "
            f"{after_each!r:.80}); pass e.g. after_each=lambda g: art.ruler_score_group(g, judge), or None"
        )


def _check_items(groups: object) -> list[Any]:
    """The groups as a list, each checked to be something that gives a group, before any rollout starts."""
    if isinstance(groups, (PendingGroup, TrajectoryGroup)):
        raise TypeError(
            f"gather_trajectory_groups takes a list of groups (got a single {type(groups).__name__}); pass a "
            "list: gather_trajectory_groups([group])"
        )
    if not isinstance(groups, Iterable):
        raise TypeError(
            f"gather_trajectory_groups takes a list of groups (got {type(groups).__name__}); pass a list of "
            "art.TrajectoryGroup(...)"
        )
    items = list(groups)
    for i, item in enumerate(items):
        if isinstance(item, (PendingGroup, TrajectoryGroup)) or inspect.isawaitable(item):
            continue
        if isinstance(item, (list, tuple)):
            fix = "wrap each list in art.TrajectoryGroup(...): [art.TrajectoryGroup(r) for r in lists]"
        elif isinstance(item, Trajectory):
            fix = "wrap the trajectories of one scenario in art.TrajectoryGroup([...])"
        else:
            fix = "pass art.TrajectoryGroup(...) for each scenario"
        raise TypeError(
            f"gather_trajectory_groups' item {i} is not a group (got {type(item).__name__}); {fix}"
        )
    return items


def _after_each_failed(
    index: int, group: TrajectoryGroup, error: Exception, policy: AfterEachErrors
) -> list[TrajectoryGroup]:
    """Log the failure; the groups to return for `group` under `policy` (the caller raises for "raise")."""
    metadata = repr(group.metadata)
    log.warning(
        "after_each failed on group %d (metadata %s); %s: %s: %s",
        index,
        metadata if len(metadata) <= 200 else metadata[:200] + "...",
        _ON_FAILURE[policy],
        type(error).__name__,
        error,
    )
    if policy != "keep":
        return []
    kept = group.model_copy(
        update={
            "metrics": {**group.metrics, AFTER_EACH_ERROR_METRIC: 1},
            "logs": [*group.logs, f"after_each failed: {type(error).__name__}: {error}"],
        }
    )
    return [kept]


async def gather_trajectory_groups(
    groups: Iterable[PendingGroup | TrajectoryGroup | Awaitable[TrajectoryGroup]],
    *,
    pbar_desc: str = "gather",
    max_exceptions: int | float = 0,
    after_each: AfterEach | None = None,
    after_each_errors: AfterEachErrors = "drop",
    max_metrics: int | None = None,
    pbar_total_completion_tokens: bool = False,
) -> GatheredGroups:
    """Run all groups concurrently under one progress bar and return the finished groups in input order.

    Example:
        groups = await art.gather_trajectory_groups(
            art.TrajectoryGroup(rollout(model, s) for _ in range(8)) for s in scenarios
        )

    max_exceptions: failed rollouts tolerated, as a count or a fraction (0-1) of all rollouts; beyond it the
        gather stops, cancels the rest and raises `TooManyExceptions` from the first failure.
    after_each: called with each finished group; may return a group, None (drop it) or a list of groups.
    after_each_errors: what an exception raised by `after_each` does to its group. "drop" (default): the group
        is left out. "keep": the group is returned as it was before `after_each` (e.g. unscored), with
        `metrics["after_each_error"] = 1` and the error in its `logs`. Either way the other groups go on, and the
        failure is logged, counted on the bar and listed in the result's `after_each_failures`.
        "raise": the exception cancels the gather and propagates (the finished groups are lost).
    max_metrics: show at most this many running means on the bar (reward first); ART's keyword.
    pbar_total_completion_tokens: ART's deprecated flag, accepted and reported once.

    Returns a `GatheredGroups`: a list of groups with `.after_each_failures` (group index and error of each).
    """
    if after_each_errors not in _ON_FAILURE:
        raise ValueError(f"after_each_errors must be 'drop', 'keep' or 'raise', got {after_each_errors!r}")
    _check_after_each(after_each)
    check_max_exceptions(max_exceptions)
    items = _check_items(groups)
    total = sum(len(g) if isinstance(g, (PendingGroup, TrajectoryGroup)) else 1 for g in items)
    _report_completion_tokens_flag("gather_trajectory_groups", pbar_total_completion_tokens)
    progress = RolloutProgress(total, pbar_desc, max_exceptions, max_metrics)
    failures: list[AfterEachFailure] = []
    token = active_progress.set(progress)

    async def finish(index: int, item: Any) -> list[TrajectoryGroup]:
        if isinstance(item, TrajectoryGroup):
            for t in item.trajectories:
                progress.add_trajectory(t)
            group = item
        else:
            group = await item
            if not isinstance(group, TrajectoryGroup):
                raise TypeError(
                    f"gather_trajectory_groups' item {index} gave {type(group).__name__}, not a group; "
                    "wrap the rollouts of each scenario in art.TrajectoryGroup(...)"
                )
        if after_each is None:
            return [group]
        try:
            out = after_each(group)
            if inspect.isawaitable(out):
                out = await out
            return _as_groups(out)  # a wrong return type is this group's after_each failure, like any other
        except Exception as error:
            failures.append(AfterEachFailure(group_index=index, error=ExceptionRecord.of(error)))
            progress.add_after_each_failure()
            kept = _after_each_failed(index, group, error, after_each_errors)
            if after_each_errors == "raise":
                raise
            return kept

    try:
        nested = await all_or_cancel(finish(i, item) for i, item in enumerate(items))
    finally:
        active_progress.reset(token)
        progress.close()
    failures.sort(key=lambda f: f.group_index)
    return GatheredGroups((g for gs in nested for g in gs), failures)


def _report_completion_tokens_flag(function: str, asked: bool) -> None:
    if asked:
        report_ignored(
            f"{function}(pbar_total_completion_tokens=True)",
            "deprecated in ART too; the bar counts rollouts and shows running means",
        )


async def gather_trajectories(
    trajectories: Iterable[Awaitable[Trajectory | list[Trajectory]]],
    *,
    pbar_desc: str = "gather",
    pbar_total_completion_tokens: bool = False,
    max_exceptions: int | float = 0,
) -> list[Trajectory | list[Trajectory] | BaseException]:
    """Like gather_trajectory_groups for bare rollouts; tolerated failures are returned in place.
    `pbar_total_completion_tokens`: ART's deprecated flag, accepted and reported once, as there."""
    _report_completion_tokens_flag("gather_trajectories", pbar_total_completion_tokens)
    items = list(trajectories)
    progress = RolloutProgress(len(items), pbar_desc, max_exceptions)

    async def one(aw: Awaitable[Any]) -> Any:
        try:
            result = await aw
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            progress.add_exception(exc)
            return exc
        trajectories = result if isinstance(result, list) else [result]
        for i, t in enumerate(trajectories):  # the bar counts rollouts; one may return several trajectories
            progress.add_trajectory(t, advance=int(i == 0))
        if not trajectories:
            progress.bar.update(1)
        return result

    try:
        return await all_or_cancel(one(a) for a in items)
    finally:
        progress.close()


def retry(
    max_attempts: int = 3,
    delay: float = 0.25,
    backoff_factor: float = 2.0,
    exceptions: tuple[type[BaseException], ...] = (Exception,),
    on_retry: Callable[[BaseException, int], Any] | None = None,
):
    """Decorator: call again on `exceptions`, waiting delay, delay*backoff, ... (sync or async functions)."""
    if max_attempts < 1:
        raise ValueError("max_attempts must be >= 1")

    def decorate(fn):
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args, **kwargs):
                wait = delay
                for attempt in range(1, max_attempts + 1):
                    try:
                        return await fn(*args, **kwargs)
                    except exceptions as exc:
                        if attempt == max_attempts:
                            raise
                        _note_retry(fn, exc, attempt, max_attempts, on_retry)
                        await asyncio.sleep(wait)
                        wait *= backoff_factor

            return async_wrapper

        @functools.wraps(fn)
        def sync_wrapper(*args, **kwargs):
            import time

            wait = delay
            for attempt in range(1, max_attempts + 1):
                try:
                    return fn(*args, **kwargs)
                except exceptions as exc:
                    if attempt == max_attempts:
                        raise
                    _note_retry(fn, exc, attempt, max_attempts, on_retry)
                    time.sleep(wait)
                    wait *= backoff_factor

        return sync_wrapper

    return decorate


def _note_retry(fn, exc, attempt, max_attempts, on_retry) -> None:
    log.warning("%s failed (attempt %d/%d): %r; retrying", fn.__qualname__, attempt, max_attempts, exc)
    if on_retry is not None:
        on_retry(exc, attempt)


__all__ = [
    "AFTER_EACH_ERROR_METRIC",
    "AfterEachFailure",
    "ExceptionRecord",
    "GatheredGroups",
    "TooManyExceptions",
    "gather_trajectories",
    "gather_trajectory_groups",
    "retry",
]
