"""What crosses the wire between `RemoteBackend` and `artnb serve`, as JSON that loses nothing training needs.

Design choices, and why:
- A trainable turn stays a `Choice` (tagged `{"choice": ...}`): its sampling logprobs and the engine's token ids
  are what the trainer uses, and rebuilding the turn from text would re-tokenise it. Plain message dicts stay
  dicts (`{"message": ...}`); the tag keeps the two apart whatever keys a message has.
- Floats go as Python's `repr` (exact round trip), and NaN and ±inf are allowed: both ends are artnb, and a
  NaN reward must reach the server to fail its check there with the same message it has locally.
- Values JSON has no type for (numpy scalars, pydantic models, anything else in metadata) are sent the way the
  run directory records them (`RunStore` writes with `default=str`), so a remote run records what a local one
  would.
- Train options are resolved on the client (`resolve_train_config`), so a misspelt option fails in the notebook;
  only the fields that were set are sent, since "unset" means "the server's default" (e.g. max_seq_length).
- `WIRE_VERSION` changes when this format does; the client refuses a server that speaks another.
- Encoding and decoding a batch pause CPython's cyclic garbage collector: a batch is millions of small dicts
  and lists, none cyclic, and the collector rescans them again and again as they are made (measured on 1,024
  rollouts of 512 sampled tokens, 54 MiB, on 2 CPU cores: 3.6 s to encode and 7.8 s to decode; 1.1 s and
  1.7 s paused). JSON takes ~107 bytes per sampled token with its logprob and id.

>>> group = groups_from_wire(loads(dumps(groups_to_wire([group]))))[0]   # what the server trains on
"""

from __future__ import annotations

import contextlib
import gc
import json
from collections.abc import Iterable
from datetime import date, datetime
from pathlib import Path
from typing import Any

from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel, ConfigDict

from .config import LoRAConfig, TrainConfig
from .gather import AfterEachFailure, GatheredGroups
from .model import Model, TrainableModel, TrainResult
from .sft import TrainSFTConfig
from .train_request import Committed, TrainOutcome
from .trajectory import History, Trajectory, TrajectoryGroup

WIRE_VERSION = 1
DEFAULT_PORT = 7999  # `artnb serve`'s port, as ART's `Backend(base_url=...)` default
API_KEY_ENV = "ARTNB_API_KEY"  # the key, on the server and in the notebook, when not passed
ERROR_HEADER = "x-artnb-error"  # a machine-readable reason on some error responses:
NOT_REGISTERED = "model-not-registered"  # the server does not serve this model (it restarted): register again

# Model fields the server sets itself (where the model is served and logged), never sent. The API key of a
# comparison model (e.g. an OpenAI key) never leaves the notebook.
_LOCAL_FIELDS = {"inference_api_key", "base_path"}
_SERVED_FIELDS = {"inference_base_url", "inference_model_name"}


@contextlib.contextmanager
def _collector_paused():
    """Pause the cyclic garbage collector (see the module docstring); nested and threaded uses are safe."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _default(obj: Any) -> Any:
    if isinstance(obj, BaseModel):
        return obj.model_dump(mode="json")
    if type(obj).__module__ == "numpy" and hasattr(obj, "item"):
        return obj.item()  # numpy scalars (np.float32 rewards, np.int64 counts) as Python numbers
    if isinstance(obj, (datetime, date)):
        return obj.isoformat()
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    return str(obj)  # as RunStore records it (json.dumps(default=str))


@_collector_paused()
def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON with NaN/±inf allowed and unknown types sent as RunStore records them."""
    return json.dumps(obj, default=_default, ensure_ascii=False, separators=(",", ":")).encode()


@_collector_paused()
def loads(data: bytes | str) -> Any:
    return json.loads(data)


# trajectories ----------------------------------------------------------------------------------------------
def _item_to_wire(item: dict[str, Any] | Choice) -> dict[str, Any]:
    if isinstance(item, Choice):
        return {"choice": item.model_dump(mode="json", warnings=False)}
    return {"message": item}


def _item_from_wire(item: dict[str, Any]) -> dict[str, Any] | Choice:
    if "choice" in item:
        return Choice.model_validate(item["choice"])
    return item["message"]


def _history_to_wire(history: History) -> dict[str, Any]:
    return {
        "messages_and_choices": [_item_to_wire(x) for x in history.messages_and_choices],
        "tools": history.tools,
    }


def trajectory_to_wire(trajectory: Trajectory) -> dict[str, Any]:
    return {
        **_history_to_wire(trajectory),
        "reward": trajectory.reward,
        "metrics": dict(trajectory.metrics),
        "metadata": dict(trajectory.metadata),
        "logs": list(trajectory.logs),
        "additional_histories": [_history_to_wire(h) for h in trajectory.additional_histories],
        "initial_policy_version": trajectory.initial_policy_version,
        "final_policy_version": trajectory.final_policy_version,
    }


def trajectory_from_wire(data: dict[str, Any]) -> Trajectory:
    return Trajectory(
        messages_and_choices=[_item_from_wire(x) for x in data["messages_and_choices"]],
        tools=data.get("tools"),
        reward=data["reward"],
        metrics=data.get("metrics", {}),
        metadata=data.get("metadata", {}),
        logs=data.get("logs", []),
        additional_histories=[
            History(
                messages_and_choices=[_item_from_wire(x) for x in h["messages_and_choices"]],
                tools=h.get("tools"),
            )
            for h in data.get("additional_histories", [])
        ],
        initial_policy_version=data.get("initial_policy_version"),
        final_policy_version=data.get("final_policy_version"),
    )


@_collector_paused()
def trajectories_to_wire(trajectories: Iterable[Trajectory]) -> list[dict[str, Any]]:
    """SFT examples (trajectories without groups)."""
    return [trajectory_to_wire(t) for t in trajectories]


@_collector_paused()
def trajectories_from_wire(data: list[dict[str, Any]]) -> list[Trajectory]:
    return [trajectory_from_wire(t) for t in data]


def group_to_wire(group: TrajectoryGroup) -> dict[str, Any]:
    return {
        "trajectories": [trajectory_to_wire(t) for t in group.trajectories],
        "exceptions": [e.model_dump() for e in group.exceptions],
        "metadata": dict(group.metadata),
        "metrics": dict(group.metrics),
        "logs": list(group.logs),
    }


def group_from_wire(data: dict[str, Any]) -> TrajectoryGroup:
    return TrajectoryGroup(
        trajectories=[trajectory_from_wire(t) for t in data["trajectories"]],
        exceptions=data.get("exceptions", []),
        metadata=data.get("metadata", {}),
        metrics=data.get("metrics", {}),
        logs=data.get("logs", []),
    )


@_collector_paused()
def groups_to_wire(groups: Iterable[TrajectoryGroup]) -> dict[str, Any]:
    """A batch, with `gather_trajectory_groups`' record of the groups its `after_each` failed on (if any)."""
    failures = getattr(groups, "after_each_failures", None)
    return {
        "groups": [group_to_wire(g) for g in groups],
        "after_each_failures": None if failures is None else [f.model_dump() for f in failures],
    }


@_collector_paused()
def groups_from_wire(data: dict[str, Any]) -> list[TrajectoryGroup]:
    """The batch; a `GatheredGroups` when it came from a gather, so the server records its failures too."""
    groups = [group_from_wire(g) for g in data["groups"]]
    failures = data.get("after_each_failures")
    if failures is None:
        return groups
    return GatheredGroups(groups, [AfterEachFailure.model_validate(f) for f in failures])


# configs and results ---------------------------------------------------------------------------------------
def config_to_wire(config: TrainConfig | TrainSFTConfig) -> dict[str, Any]:
    """The fields that were set (unset ones take the server's defaults, e.g. the model's max_seq_length)."""
    return config.model_dump(mode="json", exclude_unset=True)


def train_config_from_wire(data: dict[str, Any]) -> TrainConfig:
    return TrainConfig(**data)


def sft_config_from_wire(data: dict[str, Any]) -> TrainSFTConfig:
    return TrainSFTConfig(**data)


def result_to_wire(result: TrainResult) -> dict[str, Any]:
    return result.model_dump()


def result_from_wire(data: dict[str, Any]) -> TrainResult:
    return TrainResult.model_validate(data)


def outcome_to_wire(outcome: TrainOutcome) -> dict[str, Any]:
    """A step's reply: its result and, when it committed, what (`trained`, for the client model's record)."""
    committed = outcome.committed
    trained = (
        None
        if committed is None
        else {"steps": list(committed.steps), "commit": committed.commit, "row": committed.row}
    )
    return {"result": result_to_wire(outcome.result), "trained": trained}


def outcome_from_wire(data: dict[str, Any]) -> TrainOutcome:
    trained = data.get("trained")
    committed = (
        None
        if trained is None
        else Committed(
            (int(trained["steps"][0]), int(trained["steps"][1])), trained["commit"], trained["row"]
        )
    )
    return TrainOutcome(result_from_wire(data["result"]), committed)


# models ----------------------------------------------------------------------------------------------------
class _SentConfig(BaseModel):
    """A model's own `config`, as received: the server only records it (model.json), so any fields are kept."""

    model_config = ConfigDict(extra="allow")


def model_to_wire(model: Model) -> dict[str, Any]:
    """What the server needs to serve and record `model`: never its API key or local paths."""
    exclude = _LOCAL_FIELDS | (_SERVED_FIELDS if model.trainable else set())
    fields = model.model_dump(mode="json", exclude=exclude)
    internal = model.internal_config if isinstance(model, TrainableModel) else None
    return {"trainable": model.trainable, "fields": fields, "internal_config": internal}


def model_from_wire(data: dict[str, Any]) -> Model:
    fields = dict(data["fields"])
    fields.pop("trainable", None)
    if fields.get("config") is not None:
        fields["config"] = _SentConfig.model_validate(fields["config"])
    if data["trainable"]:
        return TrainableModel(_internal_config=data.get("internal_config"), **fields)
    return Model(**fields)


def lora_from_wire(data: dict[str, Any]) -> LoRAConfig:
    return LoRAConfig.model_validate(data)


# errors ----------------------------------------------------------------------------------------------------
def error_to_wire(error: BaseException) -> dict[str, Any]:
    """An exception as `{"type", "message"}`; the client raises the same type where it knows it."""
    return {"type": type(error).__name__, "message": str(error)}


def file_signature(path: Path) -> dict[str, int] | None:
    """Size and modification time (ns) of a file, how the mirror tells a changed file; None if absent."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
