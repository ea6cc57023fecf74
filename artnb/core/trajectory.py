"""Trajectories: what one rollout did (messages, trainable turns, reward) and groups of them.

A trajectory's `messages_and_choices` mixes OpenAI message dicts (context, never trained) with OpenAI `Choice`
objects straight from `chat.completions.create(...).choices[0]` (trainable turns: they carry the sampling
logprobs and the engine's token ids). Groups are the unit GRPO compares; `TrajectoryGroup(...)` given
coroutines returns an awaitable that runs them and keeps failures in `group.exceptions`.
"""

from __future__ import annotations

import inspect
import json
import math
import time
import traceback
from collections.abc import Awaitable, Iterable, Iterator
from contextlib import asynccontextmanager
from typing import Any, overload

from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel, ConfigDict, Field, field_validator

Message = dict[str, Any]
MessageOrChoice = Message | Choice
# ART's names for the same types (`art.Messages`, `art.MessagesAndChoices`, `art.Tools`)
Messages = list[Message]
MessagesAndChoices = list[MessageOrChoice]
Tools = list[dict[str, Any]]


def _as_item(item: Any) -> MessageOrChoice:
    if isinstance(item, (dict, Choice)):
        return item
    if isinstance(item, BaseModel) and hasattr(item, "message") and hasattr(item, "finish_reason"):
        return Choice.model_validate(item.model_dump())  # a Choice from another client library version
    if isinstance(item, BaseModel) and hasattr(item, "role"):
        return item.model_dump(exclude_none=True)  # a ChatCompletionMessage the user appended directly
    raise TypeError(
        f"messages_and_choices items must be OpenAI message dicts or Choice objects, got {type(item).__name__}; "
        "append completion.choices[0] for a trainable turn or a {'role': ..., 'content': ...} dict for context"
    )


def choice_to_message(choice: Choice) -> Message:
    """The assistant message dict a Choice stands for, as the next request's history needs it."""
    msg = choice.message
    out: Message = {"role": "assistant", "content": msg.content or ""}
    if msg.tool_calls:
        out["tool_calls"] = [tc.model_dump(exclude_none=True) for tc in msg.tool_calls]
    return out


class History(BaseModel):
    """An extra conversation trained with the trajectory's advantage (sub-agent, summarised context)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    messages_and_choices: list[Any] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None

    @field_validator("messages_and_choices", mode="before")
    @classmethod
    def _check_items(cls, v: Any) -> list[Any]:
        return [_as_item(x) for x in v]

    def messages(self) -> list[Message]:
        return [choice_to_message(x) if isinstance(x, Choice) else x for x in self.messages_and_choices]


class Trajectory(History):
    """One rollout. Set `reward` (and any `metrics`) before returning it from your rollout function."""

    reward: float = 0.0
    metrics: dict[str, float | int | bool] = Field(default_factory=dict)
    metadata: dict[str, float | int | str | bool | None] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)
    additional_histories: list[History] = Field(default_factory=list)
    # The trained step (policy version) serving when the rollout began and when it ended; PipelineTrainer sets
    # them, and a training step records how far behind it its rollouts' policies were (train/steps_off_policy).
    initial_policy_version: int | None = None
    final_policy_version: int | None = None
    start_time: float = Field(default_factory=time.monotonic, exclude=True)

    def log(self, message: str) -> None:
        self.logs.append(message)

    def __enter__(self) -> Trajectory:
        """`with art.Trajectory() as t:` records the chat completions made inside into `t` (capture.py)."""
        from .capture import enter_trajectory

        return enter_trajectory(self)

    def __exit__(self, *exc_info: Any) -> None:
        from .capture import exit_trajectory

        exit_trajectory(self, failed=exc_info[0] is not None)

    def finish(self) -> Trajectory:
        self.metrics["duration"] = time.monotonic() - self.start_time
        return self

    @asynccontextmanager
    async def track_duration(self, name: str):
        """`async with traj.track_duration("llm"):` adds the elapsed seconds to `metrics["llm_duration"]`."""
        start = time.monotonic()
        try:
            yield
        finally:
            key = f"{name}_duration"
            self.metrics[key] = float(self.metrics.get(key, 0.0)) + time.monotonic() - start

    def trainable_turns(self) -> int:
        return sum(isinstance(x, Choice) for h in self.histories() for x in h.messages_and_choices)

    def histories(self) -> list[History]:
        return [self, *self.additional_histories]

    def for_logging(self) -> dict[str, Any]:
        """A JSON-friendly record: messages flagged `trainable`, per-token logprobs of trainable turns kept."""
        messages = []
        for item in self.messages_and_choices:
            if isinstance(item, Choice):
                m = choice_to_message(item)
                m["trainable"] = True
                if item.logprobs and item.logprobs.content:
                    m["logprobs"] = [{"token": t.token, "logprob": t.logprob} for t in item.logprobs.content]
                messages.append(m)
            else:
                messages.append({**item, "trainable": False})
        return {
            "reward": self.reward,
            "metrics": dict(self.metrics),
            "metadata": dict(self.metadata),
            "logs": list(self.logs),
            "tools": self.tools,
            "messages": messages,
        }


class ExceptionRecord(BaseModel):
    type: str
    message: str
    traceback: str

    @classmethod
    def of(cls, exc: BaseException) -> ExceptionRecord:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(type=type(exc).__name__, message=str(exc), traceback=tb)


class TrajectoryGroup(BaseModel):
    """Trajectories of the same scenario, compared with each other by GRPO.

    `TrajectoryGroup([t1, t2])` holds finished trajectories. `TrajectoryGroup(rollout(...) for _ in range(8))`
    returns an awaitable: `await` it (or pass it to `gather_trajectory_groups`) to run the rollouts.
    """

    trajectories: list[Trajectory] = Field(default_factory=list)
    exceptions: list[ExceptionRecord] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)
    metrics: dict[str, float | int | bool] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)

    @overload
    def __new__(
        cls, trajectories: Iterable[Trajectory | BaseException] | None = None, /, **kwargs: Any
    ) -> TrajectoryGroup: ...
    @overload
    def __new__(
        cls, trajectories: Iterable[Awaitable[Trajectory] | Trajectory], /, **kwargs: Any
    ) -> PendingGroup: ...
    def __new__(cls, trajectories: Any = None, /, **kwargs: Any) -> TrajectoryGroup | PendingGroup:
        if trajectories is not None and not isinstance(trajectories, list):
            trajectories = list(trajectories)
        if trajectories and any(inspect.isawaitable(t) for t in trajectories):
            return PendingGroup(trajectories, **kwargs)
        obj = super().__new__(cls)
        vars(obj)["_pending_items"] = trajectories
        return obj

    def __init__(self, trajectories: Any = None, /, **kwargs: Any) -> None:
        items = vars(self).pop("_pending_items", None)
        if items is None and trajectories is not None:
            items = list(trajectories)
        trajs = [t for t in (items or []) if isinstance(t, Trajectory)]
        errors = [ExceptionRecord.of(t) for t in (items or []) if isinstance(t, BaseException)]
        bad = [t for t in (items or []) if not isinstance(t, (Trajectory, BaseException))]
        if bad:
            raise TypeError(
                f"TrajectoryGroup items must be Trajectory objects (or awaitables of them), got {type(bad[0]).__name__}"
            )
        if "trajectories" in kwargs:
            trajs = list(kwargs.pop("trajectories")) + trajs
        errors = [_as_record(e) for e in kwargs.pop("exceptions", [])] + errors
        super().__init__(trajectories=trajs, exceptions=errors, **kwargs)

    def __iter__(self) -> Iterator[Trajectory]:  # type: ignore[override]
        return iter(self.trajectories)

    def __len__(self) -> int:
        return len(self.trajectories)

    def __getitem__(self, i: int) -> Trajectory:
        return self.trajectories[i]

    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    def __enter__(self) -> TrajectoryGroup:
        """`with art.TrajectoryGroup() as group:` collects each trajectory captured inside (capture.py)."""
        from .capture import enter_group

        return enter_group(self)

    def __exit__(self, *exc_info: Any) -> None:
        from .capture import exit_group

        exit_group(self)


def _as_record(error: Any) -> ExceptionRecord:
    """`exceptions=[...]` may hold raw exceptions (as in ART) or records (as read back from disk)."""
    return (
        ExceptionRecord.of(error)
        if isinstance(error, BaseException)
        else ExceptionRecord.model_validate(error)
    )


class PendingGroup:
    """A group whose rollouts have not run yet. Awaiting it runs them concurrently."""

    def __init__(self, awaitables: Iterable[Awaitable[Trajectory] | Trajectory], **group_kwargs: Any) -> None:
        self.awaitables = list(awaitables)
        self.group_kwargs = group_kwargs

    def __len__(self) -> int:
        return len(self.awaitables)

    def __await__(self):
        return self._run().__await__()

    async def _run(self) -> TrajectoryGroup:
        from .progress import run_rollouts  # imports tqdm: when a group runs, not at `import artnb`

        results = await run_rollouts(self.awaitables, Trajectory)
        return TrajectoryGroup(results, **self.group_kwargs)


def shared_prefix(lists: list[list[Any]]) -> int:
    """How many leading messages every conversation has in common (a judge shows those once, as the task)."""
    n = 0
    while all(len(m) > n for m in lists) and all(m[n] == lists[0][n] for m in lists[1:]):
        n += 1
    return n


# Rewards beyond this overflow on the way to the loss: a group's spread squares them (1e308 -> inf), and unscaled
# advantages (scale_rewards=False) of that size overflow the loss in float32 (max 3.4e38).
MAX_ABS_REWARD = 1e12


def reward_problem(reward: Any) -> str | None:
    """Why training cannot use `reward` (not a number, NaN or infinite, too large to compare), or None."""
    if not isinstance(reward, (int, float)) or isinstance(reward, bool) or not math.isfinite(reward):
        return "rewards must be finite numbers"
    if abs(reward) > MAX_ABS_REWARD:
        return f"beyond +-{MAX_ABS_REWARD:g}, its group's advantages and the loss would overflow"
    return None


def check_rewards(groups: Iterable[TrajectoryGroup]) -> None:
    """Raise naming the trajectory if a reward is not a finite number of a size training can compare."""
    for gi, group in enumerate(groups):
        for ti, t in enumerate(group.trajectories):
            problem = reward_problem(t.reward)
            if problem is None:
                continue
            fix = (
                "Scale the reward down (GRPO compares rewards within a group, so a common factor changes nothing)"
                if "beyond" in problem
                else "Fix the rollout's reward (e.g. guard a division by zero)"
            )
            raise ValueError(
                f"group {gi}, trajectory {ti} has reward {t.reward!r}; {problem}. {fix} before training; "
                "nothing was trained."
            )


def dumps_json(obj: Any) -> str:
    return json.dumps(obj, default=str, ensure_ascii=False)
