"""Captured trajectories: the chat completions a rollout makes inside a scope are recorded into its Trajectory.

Why: an agent written with the OpenAI SDK, LangChain or litellm keeps its own message lists; copying each request
and each `choices[0]` into `messages_and_choices` by hand repeats that bookkeeping, and a turn left out is a turn
never trained. Inside `await art.trajectory(rollout(...))` (or `with art.Trajectory() as t:`), every chat
completion sent over httpx is recorded (http_capture.py): the request's messages and tools as context, the
response's first choice as a trainable turn, engine token ids included, so the trainer trains exactly the
sampled tokens. The rollout sets the reward on `art.current_trajectory()`, or returns it.

Where a call goes: into the main history when that history is a prefix of the request's messages (an agent loop
resending its conversation), else into the additional history it continues, else a new additional history (a
sub-agent, a summarised context). Scopes live in contextvars, so concurrent rollouts never see each other's calls;
calls outside a scope, or inside `art.no_capture()`, are not touched. artnb's own judge requests are not captured.

ART's spellings: `trajectory`, `trajectory_group`, `current_trajectory`, `current_trajectory_group`, the
deprecated `auto_trajectory` / `capture_auto_trajectory`, and `yield_trajectory` / `capture_yielded_trajectory`.
Unlike ART, a rollout may return its reward (a number) or a Trajectory it built itself (a classic rollout wrapped).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import numbers
import warnings
from collections.abc import Coroutine, Iterable, Iterator
from contextvars import ContextVar
from typing import Any, Literal, overload

from openai.types.chat.chat_completion import Choice

from .trajectory import History, Message, Trajectory, TrajectoryGroup

_trajectories: ContextVar[tuple[Trajectory, ...]] = ContextVar("artnb_trajectories", default=())
_groups: ContextVar[tuple[TrajectoryGroup, ...]] = ContextVar("artnb_trajectory_groups", default=())
_paused: ContextVar[bool] = ContextVar("artnb_capture_paused", default=False)
_yielded: ContextVar[list[Trajectory] | None] = ContextVar("artnb_yielded_trajectory", default=None)


def _required(require: bool | None, required: bool | None, call: str) -> bool:
    """ART's `require=` and artnb's older `required=` mean the same; both given and different is a slip."""
    if require is not None and required is not None and bool(require) != bool(required):
        raise TypeError(f"{call} got require={require!r} and required={required!r}; pass only require=")
    return bool(require if require is not None else required)


@overload
def current_trajectory(*, require: Literal[True], required: bool | None = None) -> Trajectory: ...
@overload
def current_trajectory(*, require: bool | None = None, required: bool | None = None) -> Trajectory | None: ...
def current_trajectory(*, require: bool | None = None, required: bool | None = None) -> Trajectory | None:
    """The trajectory the innermost capture scope records into: None outside one, or with `require=True`
    (ART's keyword; `required=` is the same) a RuntimeError saying how to open one."""
    scopes = _trajectories.get()
    if scopes:
        return scopes[-1]
    if _required(require, required, "current_trajectory()"):
        raise RuntimeError(
            "no trajectory is being captured here: run the rollout as `await art.trajectory(rollout(...))` or "
            "inside `with art.Trajectory() as trajectory:`"
        )
    return None


def current_trajectory_group(
    *, require: bool | None = None, required: bool | None = None
) -> TrajectoryGroup | None:
    """The group of the innermost `with art.TrajectoryGroup() as group:` block: None outside one, or with
    `require=True` (as `current_trajectory`'s; `required=` is the same) a RuntimeError."""
    groups = _groups.get()
    if groups:
        return groups[-1]
    if _required(require, required, "current_trajectory_group()"):
        raise RuntimeError("no trajectory group is open here: use `with art.TrajectoryGroup() as group:`")
    return None


def enter_trajectory(trajectory: Trajectory) -> Trajectory:
    from . import http_capture

    http_capture.install()
    _trajectories.set((*_trajectories.get(), trajectory))
    return trajectory


def exit_trajectory(trajectory: Trajectory, failed: bool = False) -> None:
    """Close the innermost scope; a trajectory that ended normally joins the open group, if any."""
    scopes = _trajectories.get()
    if not scopes or scopes[-1] is not trajectory:
        raise RuntimeError("capture scopes must close in the order they opened (innermost first)")
    _trajectories.set(scopes[:-1])
    trajectory.finish()
    group = current_trajectory_group()
    if group is not None and not failed and all(t is not trajectory for t in group.trajectories):
        group.trajectories.append(trajectory)


def enter_group(group: TrajectoryGroup) -> TrajectoryGroup:
    _groups.set((*_groups.get(), group))
    return group


def exit_group(group: TrajectoryGroup) -> None:
    groups = _groups.get()
    if not groups or groups[-1] is not group:
        raise RuntimeError("trajectory group blocks must close in the order they opened (innermost first)")
    _groups.set(groups[:-1])


@contextlib.contextmanager
def no_capture() -> Iterator[None]:
    """Calls made inside are not recorded (a judge, a tool that calls an LLM of its own)."""
    token = _paused.set(True)
    try:
        yield
    finally:
        _paused.reset(token)


def capturing() -> Trajectory | None:
    """The trajectory a call made now should be recorded into, if any."""
    return None if _paused.get() else current_trajectory()


def _check_coroutine(value: Any, name: str) -> None:
    if not inspect.iscoroutine(value):
        raise TypeError(
            f"{name} takes a coroutine, got {type(value).__name__}: pass the rollout's call without awaiting it, "
            f"e.g. `await {name}(rollout(model, scenario))`"
        )


async def trajectory(coroutine: Coroutine[Any, Any, Any], *, take_calls: bool = False) -> Trajectory:
    """Run `coroutine` and return the Trajectory of the chat completions it made.

    If the rollout returns a number, it is the reward; if it returns a Trajectory, that one is the result, and
    with `take_calls` its histories are replaced by the captured calls (art.langgraph's `wrap_rollout`).
    """
    _check_coroutine(coroutine, "art.trajectory")
    with Trajectory() as captured:
        result = await coroutine
    if isinstance(result, Trajectory):
        if (group := current_trajectory_group()) is not None:  # the rollout's own trajectory stands for it
            group.trajectories = [result if t is captured else t for t in group.trajectories]
        if take_calls:
            result.messages_and_choices = captured.messages_and_choices
            result.tools = captured.tools
            result.additional_histories = [*captured.additional_histories, *result.additional_histories]
            result.finish()
        return result
    if isinstance(result, (int, float)) and not isinstance(result, bool):
        captured.reward = float(result)
    return captured


async def own_or_captured(rollout: Any) -> Any:
    """What a rollout gave; when that is its reward (a number), the Trajectory its chat calls were captured into.

    For functions that take a user's rollout of either kind and play it themselves (`art.preflight`,
    `art.evaluate`): a rollout that returns a Trajectory, or several, is unchanged.
    """
    with Trajectory() as captured:
        result = await rollout if inspect.isawaitable(rollout) else rollout
    if isinstance(result, numbers.Real) and not isinstance(result, bool):
        captured.reward = float(result)
        return captured
    return result


async def trajectory_group(
    rollouts: Iterable[Coroutine[Any, Any, Any]], *, return_exceptions: bool = False, **group_fields: Any
) -> TrajectoryGroup:
    """Run rollouts concurrently, each captured as by `trajectory`, and return their group.

    With `return_exceptions=True` a failed rollout is kept in `group.exceptions` instead of raising.
    """
    coroutines = list(rollouts)
    for coroutine in coroutines:
        _check_coroutine(coroutine, "art.trajectory_group")
    results = await asyncio.gather(*(trajectory(c) for c in coroutines), return_exceptions=return_exceptions)
    return TrajectoryGroup(results, **group_fields)


def yield_trajectory(trajectory: Trajectory) -> None:
    """Hand `trajectory` to the enclosing `capture_yielded_trajectory` (from code that cannot return it)."""
    if not isinstance(trajectory, Trajectory):
        raise TypeError(f"yield_trajectory takes an art.Trajectory (got {type(trajectory).__name__})")
    slot = _yielded.get()
    if slot is None:
        raise RuntimeError("yield_trajectory is called outside `await art.capture_yielded_trajectory(...)`")
    slot.append(trajectory)


async def capture_yielded_trajectory(coroutine: Coroutine[Any, Any, Any]) -> Trajectory:
    """Run `coroutine` and return the last Trajectory it passed to `yield_trajectory`."""
    _check_coroutine(coroutine, "art.capture_yielded_trajectory")
    slot: list[Trajectory] = []
    token = _yielded.set(slot)
    try:
        await coroutine
    finally:
        _yielded.reset(token)
    if not slot:
        raise RuntimeError("the coroutine finished without calling art.yield_trajectory(trajectory)")
    return slot[-1]


def auto_trajectory(*, required: bool = False) -> Trajectory | None:
    """Deprecated (ART 0.4): use `current_trajectory()`."""
    warnings.warn(
        "auto_trajectory() is deprecated: use art.current_trajectory()", DeprecationWarning, stacklevel=2
    )
    return current_trajectory(required=required)


async def capture_auto_trajectory(coroutine: Coroutine[Any, Any, Any]) -> Trajectory:
    """Deprecated (ART 0.4): use `await art.trajectory(coroutine)`."""
    warnings.warn(
        "capture_auto_trajectory() is deprecated: use art.trajectory()", DeprecationWarning, stacklevel=2
    )
    return await trajectory(coroutine)


# Recording --------------------------------------------------------------------------------------------------


def record_chat(trajectory: Trajectory, request: dict[str, Any], completion: dict[str, Any]) -> None:
    """Add one chat exchange (the request's JSON, the response's JSON) to `trajectory`."""
    choices = completion.get("choices") or []
    messages = request.get("messages")
    if not choices or not isinstance(messages, list):
        return
    choice = Choice.model_validate(choices[0])
    tools = request.get("tools")
    for history in trajectory.histories():
        done = history.messages()
        if (history is trajectory and not done) or _continues(done, messages):
            if history.tools is None and tools:
                history.tools = tools
            history.messages_and_choices.extend([*messages[len(done) :], choice])
            return
    trajectory.additional_histories.append(History(messages_and_choices=[*messages, choice], tools=tools))


def _continues(done: list[Message], messages: list[Any]) -> bool:
    return 0 < len(done) <= len(messages) and all(
        _key(a) == _key(b) for a, b in zip(done, messages, strict=False)
    )


def _key(message: Any) -> tuple[Any, ...]:
    """What must match for a sent message to be the one recorded: role, text and tool calls (ids and
    whitespace in arguments may be rewritten by the agent framework)."""
    if not isinstance(message, dict):
        return (message,)
    content = message.get("content")
    if isinstance(content, list):  # content parts: keep their text
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if isinstance(arguments, (str, bytes, bytearray)):
            with contextlib.suppress(ValueError):
                arguments = json.loads(arguments)
        calls.append((function.get("name"), json.dumps(arguments, sort_keys=True)))
    return (message.get("role"), content or "", calls)
