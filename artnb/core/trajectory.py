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
import numbers
import time
import traceback
from collections.abc import Awaitable, Iterable, Iterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, overload

from openai.types.chat.chat_completion import Choice
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

from .ignored import report_ignored
from .names import nearest

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


def _as_items(value: Any) -> list[MessageOrChoice]:
    """The conversation as a list of items; a TypeError saying how to fix the common slips (one message instead
    of a list of them, None), which would otherwise fail on the message's keys or on iterating None."""
    wanted = "messages_and_choices takes a list of messages and choices"
    if value is None:
        raise TypeError(f"{wanted} (got None); pass [] for an empty conversation, or leave the argument out")
    if isinstance(value, (Mapping, Choice, BaseModel)):
        raise TypeError(
            f"{wanted} (got {type(value).__name__}); wrap the one message in a list: "
            "messages_and_choices=[message]"
        )
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(
            f"{wanted} (got {type(value).__name__} {value!r:.60}); pass e.g. "
            "[{'role': 'user', 'content': 'Hello'}], appending completion.choices[0] for each trainable turn"
        )
    return [_as_item(x) for x in value]


def check_keywords(model: type[BaseModel], given: Iterable[str]) -> None:
    """pydantic drops a keyword the model has no field for, silently: a misspelling (`messages_and_choice=`)
    would lose what it carried. A near miss of a field is a TypeError naming the field; any other unknown
    keyword (a field of a newer ART, e.g. `exchanges`) is reported once as ignored, so that ART code still runs.
    A user's subclass keeps pydantic's own rules: its aliases are names, and `extra="allow"` keeps anything."""
    if model.model_config.get("extra") == "allow":
        return
    kind, known = model.__name__, sorted(_field_names(model))
    for key in given:
        if key in known:
            continue
        close = nearest(key, known, cutoff=0.75)
        if close:
            raise TypeError(f"{kind} has no field {key!r} (got {key}=...); did you mean {close[0]}=?")
        report_ignored(
            f"{kind}({key}=...)", f"{kind} has no such field here (its fields: {', '.join(known)})"
        )


def _field_names(model: type[BaseModel]) -> set[str]:
    """What a keyword may be called: each field's name and its aliases."""
    names = set(model.model_fields)
    for field in model.model_fields.values():
        names |= {a for a in (field.alias, field.validation_alias) if isinstance(a, str)}
        if isinstance(field.validation_alias, AliasChoices):
            names |= {c for c in field.validation_alias.choices if isinstance(c, str)}
    return names


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

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            check_keywords(cls, data)
        return data

    @field_validator("messages_and_choices", mode="before")
    @classmethod
    def _check_items(cls, v: Any) -> list[Any]:
        return _as_items(v)

    def messages(self) -> list[Message]:
        return [choice_to_message(x) if isinstance(x, Choice) else x for x in self.messages_and_choices]


class Trajectory(History):
    """One rollout. Set `reward` (and any `metrics`) before returning it from your rollout function."""

    reward: float = 0.0
    metrics: dict[str, float | int | bool] = Field(default_factory=dict)
    # any JSON value (as in ART): checked when the trajectory is logged or trained (metadata_problem), since
    # rollouts also fill it in after construction
    metadata: dict[str, Any] = Field(default_factory=dict)
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
        """A JSON-friendly record: messages flagged `trainable`, per-token logprobs of trainable turns kept, and
        each additional history (a self-play opponent, a sub-agent) the same way."""
        return {
            "reward": self.reward,
            "metrics": dict(self.metrics),
            "metadata": dict(self.metadata),
            "logs": list(self.logs),
            "tools": self.tools,
            "messages": _logged_messages(self.messages_and_choices),
            "additional_histories": [
                {"messages": _logged_messages(h.messages_and_choices), "tools": h.tools}
                for h in self.additional_histories
            ],
        }


def _logged_messages(items: list[Any]) -> list[dict[str, Any]]:
    messages = []
    for item in items:
        if isinstance(item, Choice):
            m = choice_to_message(item)
            m["trainable"] = True
            if item.logprobs and item.logprobs.content:
                m["logprobs"] = [{"token": t.token, "logprob": t.logprob} for t in item.logprobs.content]
            messages.append(m)
        else:
            messages.append({**item, "trainable": False})
    return messages


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

    def log(self, message: str) -> None:
        """Add a line to the group's `logs` (ART's call), recorded with the group's rollouts."""
        self.logs.append(message)

    @overload
    def __new__(
        cls, trajectories: Iterable[Trajectory | BaseException] | None = None, /, **kwargs: Any
    ) -> TrajectoryGroup: ...
    @overload
    def __new__(
        cls, trajectories: Iterable[Awaitable[Trajectory] | Trajectory], /, **kwargs: Any
    ) -> PendingGroup: ...
    def __new__(cls, trajectories: Any = None, /, **kwargs: Any) -> TrajectoryGroup | PendingGroup:
        check_keywords(cls, kwargs)  # here too, so a pending group fails early
        if isinstance(trajectories, (Trajectory, Mapping, str)):  # iterating these gives fields or letters
            raise TypeError(
                f"TrajectoryGroup takes a list of trajectories (got {type(trajectories).__name__}); wrap them in "
                "a list: art.TrajectoryGroup([trajectory, ...])"
            )
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
                f"TrajectoryGroup items must be Trajectory objects or awaitables of them (got "
                f"{type(bad[0]).__name__}); return an art.Trajectory from each rollout"
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


def real_number(value: Any) -> int | float | bool | None:
    """`value` as a Python number if it is a real number (int, float, bool, or a numpy scalar of one), else None.

    numpy scalars are converted because the history and rollout files are JSON, which has no float32."""
    if isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if getattr(getattr(value, "dtype", None), "kind", None) == "b":  # numpy's bool_ is not a numbers.Real
        return bool(value)
    return None


def reward_problem(reward: Any) -> str | None:
    """Why training cannot use `reward` (not a number, NaN or infinite, too large to compare), or None."""
    value = real_number(reward)
    if value is None or isinstance(value, bool):
        return f"rewards must be numbers (got {type(reward).__name__})"
    if not math.isfinite(value):
        return "rewards must be finite numbers"
    if abs(value) > MAX_ABS_REWARD:
        return f"beyond +-{MAX_ABS_REWARD:g}, its group's advantages and the loss would overflow"
    return None


def metrics_problem(where: str, metrics: Any) -> str | None:
    """Why `metrics` (of a trajectory or group, named by `where`) cannot be averaged into the history, or None.
    NaN is allowed: averages leave it out, as they do in ART."""
    if not isinstance(metrics, Mapping):
        return (
            f"{where} has metrics {metrics!r:.80} (got {type(metrics).__name__}); metrics must be a dict of "
            "name -> number, e.g. {'win': 1}"
        )
    for key, value in metrics.items():
        if not isinstance(key, str):
            return f"{where} has a metric named {key!r} (got {type(key).__name__}); name metrics with strings"
        if real_number(value) is None:
            return (
                f"{where} has metrics[{key!r}] = {value!r:.80} (got {type(value).__name__}); metrics must be "
                f"numbers (int, float or bool): record a number (e.g. 1 for a win, 0 for a loss), or keep text "
                f"in metadata[{key!r}] instead"
            )
    return None


def trajectory_problem(
    group_index: int, traj_index: int, trajectory: Trajectory, for_training: bool = True
) -> str | None:
    """What makes a trajectory unusable for training or logging (its reward or a metric), as a sentence naming
    the group, trajectory and key and saying how to fix it; None when it is fine. Every check of rollout values
    goes through here, so `model.log` and `model.train` refuse the same things before doing any work."""
    where = f"group {group_index}, trajectory {traj_index}"
    problem = reward_problem(trajectory.reward)
    if problem is not None and not for_training and real_number(trajectory.reward) is not None:
        problem = (
            None  # a NaN or huge reward can be recorded (averages leave non-finite ones out), not trained
        )
    if problem is not None:
        if "beyond" in problem:
            fix = "Scale the reward down (GRPO compares rewards within a group, so a common factor changes nothing)"
        elif "finite" in problem:
            fix = "Fix the rollout's reward (e.g. guard a division by zero)"
        else:
            fix = "Set the reward to a number (e.g. 1.0 for a win, 0.0 for a loss)"
        return f"{where} has reward {trajectory.reward!r}; {problem}. {fix}"
    return metrics_problem(where, trajectory.metrics) or metadata_problem(where, trajectory.metadata)


def metadata_problem(where: str, metadata: Any) -> str | None:
    """Why `metadata` (of a trajectory, named by `where`) would not come back from the run directory or a
    remote server as it was given, or None. Any JSON value is fine (nested dicts and lists too); numpy scalars
    count as numbers (check_trajectories makes them Python numbers)."""
    if not isinstance(metadata, Mapping):
        return (
            f"{where} has metadata {metadata!r:.80} (got {type(metadata).__name__}); metadata must be a dict "
            "of name -> JSON value, e.g. {'scenario': 'easy-3', 'tags': ['a']}"
        )
    for key, value in metadata.items():
        if not isinstance(key, str):
            return (
                f"{where} has a metadata key {key!r} (got {type(key).__name__}); name metadata with strings"
            )
        path = _not_json(value, f"metadata[{key!r}]")
        if path is not None:
            bad, kind = path
            return (
                f"{where} has {bad} of type {kind}, which JSON cannot hold, so it would not come back from the "
                "run directory as it was; store a JSON value instead (str, number, bool, None, or lists and "
                "dicts with string keys of those): e.g. str(value), value.isoformat() for a date, or "
                "value.model_dump(mode='json') for a pydantic model"
            )
    return None


def _not_json(value: Any, path: str) -> tuple[str, str] | None:
    """(where, type name) of the first part of `value` that is not a JSON value, or None."""
    if value is None or isinstance(value, (str, bool, int, float)) or real_number(value) is not None:
        return None
    if isinstance(value, (list, tuple)):
        return next(filter(None, (_not_json(v, f"{path}[{i}]") for i, v in enumerate(value))), None)
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                return f"{path} key {k!r}", type(k).__name__
            if (found := _not_json(v, f"{path}[{k!r}]")) is not None:
                return found
        return None
    return path, type(value).__name__


def _plain_json(value: Any) -> Any:
    """`value` with numpy scalars as Python numbers and tuples as lists: what reading it back gives."""
    if isinstance(value, Mapping):
        return {k: _plain_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_json(v) for v in value]
    if value is None or type(value) in (str, bool, int, float):
        return value
    number = real_number(value)
    return value if number is None else number


def check_trajectories(
    groups: Iterable[TrajectoryGroup], then: str = "Nothing was trained", for_training: bool = True
) -> None:
    """Raise a ValueError naming the group, trajectory and key if a reward is not a number (for training: not a
    finite number of a size training can compare), a metric (of a trajectory or group) is not a number, or a
    trajectory's metadata is not JSON. `then` ends the message (what was not done). When all is well, numpy
    scalars among rewards, metrics and metadata become Python numbers (and tuples in metadata lists)."""
    groups = list(groups)
    for gi, group in enumerate(groups):
        problems = (trajectory_problem(gi, ti, t, for_training) for ti, t in enumerate(group.trajectories))
        problem = metrics_problem(f"group {gi}", group.metrics) or next(filter(None, problems), None)
        if problem is not None:
            raise ValueError(f"{problem}. {then}.")
    for group in groups:
        _plain_numbers(group.metrics)
        for t in group.trajectories:
            t.reward = float(t.reward)
            _plain_numbers(t.metrics)
            t.metadata = _plain_json(t.metadata)


def check_metadata(trajectories: Iterable[Trajectory], then: str, group: int | None = None) -> None:
    """`metadata_problem` as a ValueError for the first trajectory (of group `group`) that has one, ending with
    `then`. A train request checks this where it is made: on its way to a remote server a non-JSON value would
    become text."""
    prefix = "" if group is None else f"group {group}, "
    for i, trajectory in enumerate(trajectories):
        if (problem := metadata_problem(f"{prefix}trajectory {i}", trajectory.metadata)) is not None:
            raise ValueError(f"{problem}. {then}.")


def _plain_numbers(metrics: dict[str, Any]) -> None:
    for key, value in metrics.items():
        if type(value) not in (bool, int, float):
            metrics[key] = real_number(value)


def dumps_json(obj: Any) -> str:
    return json.dumps(obj, default=str, ensure_ascii=False)
