"""Langfuse traces of a run: one trace per trajectory, its chat completions as generations, its reward as scores.

Why it exists: ART users look at rollouts in Langfuse. A rollout's completions are made long before the
trajectory they belong to is known (a trajectory is only complete when it is logged or trained on), so this
module records each completion made through `model.openai_client()` (model served, input, output, token usage,
start and end time) keyed by its `Choice` object, and when the trajectory holding that Choice is reported it
writes the trace: a root span per trajectory (name "<model> <split> step <n>", metadata: project, split, step,
group and trajectory index, trajectory metrics and metadata), a generation per trainable turn (the recorded
completion, or, for a completion made with another client, one built from the Choice without timings), and
scores: `reward`, `ruler_score` with RULER's explanation as comment, and the other numeric trajectory metrics.

Opt in with LANGFUSE_PUBLIC_KEY and LANGFUSE_SECRET_KEY (host from LANGFUSE_BASE_URL or LANGFUSE_HOST, default
Langfuse Cloud), or call `enable_langfuse(public_key=..., secret_key=..., host=...)` before the model makes its
client or logs. Without either, langfuse is never imported. Langfuse's SDK sends everything from its background
threads; a Langfuse host that is down or slow costs the training loop nothing but one warning.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import wraps
from typing import TYPE_CHECKING, Any

from openai.types.chat.chat_completion import Choice

from ..core.ignored import warn_user
from ..core.trajectory import choice_to_message

if TYPE_CHECKING:
    from pydantic import BaseModel

    from ..core.model import Model
    from ..core.trajectory import Trajectory, TrajectoryGroup

DEFAULT_HOST = "https://cloud.langfuse.com"
CLOSE_TIMEOUT_S = 10.0  # longest `close()` waits for the SDK to send what it holds
MAX_CALLS = 20_000  # completions remembered at most (each is also forgotten when its Choice is freed)
PARAMETERS = (
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "seed",
    "n",
    "stop",
    "logprobs",
    "top_logprobs",
    "frequency_penalty",
    "presence_penalty",
)

_explicit: dict[str, str] | None = None


def enable_langfuse(public_key: str, secret_key: str, host: str | None = None) -> None:
    """Send traces to Langfuse without environment variables.

    Call it before `model.openai_client()`, `model.register(...)` training or `model.log(...)`: a model picks
    its reporters once, on first use. `host` defaults to LANGFUSE_BASE_URL / LANGFUSE_HOST, then Langfuse Cloud.
    """
    global _explicit
    _explicit = {"public_key": public_key, "secret_key": secret_key, "host": host or _env_host()}


def reporter_for(model: Model) -> LangfuseReporter | None:
    """A reporter when Langfuse is asked for (keys in the environment or `enable_langfuse`), else None."""
    settings = _explicit
    if settings is None:
        public, secret = os.environ.get("LANGFUSE_PUBLIC_KEY"), os.environ.get("LANGFUSE_SECRET_KEY")
        if not (public and secret):
            return None
        settings = {"public_key": public, "secret_key": secret, "host": _env_host()}
    return LangfuseReporter(**settings)  # a client the model made before is given to it as it starts


def _env_host() -> str:
    return (os.environ.get("LANGFUSE_BASE_URL") or os.environ.get("LANGFUSE_HOST") or DEFAULT_HOST).rstrip(
        "/"
    )


@dataclass
class _Call:
    """One chat completion as `instrument` saw it."""

    model: str
    input: Any
    parameters: dict[str, Any]
    start_ns: int
    end_ns: int
    usage: dict[str, int] = field(default_factory=dict)


# completions seen by any reporter's hook, process-wide: a model's client keeps the hook of the reporter that
# instrumented it, and a closed model gets a new reporter on its next report
_calls: dict[int, tuple[weakref.ref, _Call]] = {}  # id(Choice) -> (the Choice, its call)
_by_content: OrderedDict[str, _Call] = OrderedDict()  # the same, by content: for copies (RULER copies groups)


def _trim(table: dict[Any, Any]) -> None:
    """Forget the oldest entries (dicts keep insertion order) beyond MAX_CALLS."""
    while len(table) > MAX_CALLS:
        table.pop(next(iter(table)), None)


class LangfuseReporter:
    name = "Langfuse"

    def __init__(self, public_key: str, secret_key: str, host: str) -> None:
        from langfuse import Langfuse

        self.host = host.rstrip("/")
        self.url: str | None = None  # the project's traces page, once the project id is known
        self.client = Langfuse(public_key=public_key, secret_key=secret_key, base_url=self.host)
        self._unreachable: str | None = None
        self._warned = False
        threading.Thread(target=self._find_project, name="artnb-langfuse-project", daemon=True).start()

    # -- completions ---------------------------------------------------------------------------------------

    def instrument(self, model: Model, client: Any) -> None:
        completions = client.chat.completions
        if getattr(completions.create, "_artnb_langfuse", False):
            return
        wrapped = completions.__dict__.get("create")  # another tracer's wrapper on this client, if any

        @wraps(completions.create)
        async def create_and_record(*args: Any, **kwargs: Any) -> Any:
            # the class's method looked up per call, so a later class-level patch (Weave's) still applies
            create = wrapped or type(completions).create.__get__(completions)
            start = time.time_ns()
            response = await create(*args, **kwargs)
            try:
                self._remember(kwargs, response, start, time.time_ns())
            except Exception:  # recording must never change what the caller gets
                pass
            return response

        create_and_record._artnb_langfuse = True  # type: ignore[attr-defined]
        completions.create = create_and_record

    def _remember(self, request: dict[str, Any], response: Any, start_ns: int, end_ns: int) -> None:
        choices = getattr(response, "choices", None)
        if not isinstance(choices, list):  # a stream: not recorded
            return
        usage = response.usage
        usage_details = (
            {"input": usage.prompt_tokens, "output": usage.completion_tokens, "total": usage.total_tokens}
            if usage is not None
            else {}
        )
        for n, choice in enumerate(choices):
            call = _Call(
                model=response.model,
                input=list(request.get("messages") or []),
                parameters={k: _plain(request[k]) for k in PARAMETERS if request.get(k) is not None},
                start_ns=start_ns,
                end_ns=end_ns,
                usage=usage_details if n == 0 else {},  # the request's usage, on its first choice
            )
            key = id(choice)
            _calls[key] = (weakref.ref(choice, lambda _, key=key: _calls.pop(key, None)), call)
            if fingerprint := _fingerprint(choice):
                _by_content[fingerprint] = call
            _trim(_calls)
            _trim(_by_content)

    def _call_for(self, choice: Choice) -> _Call | None:
        found = _calls.get(id(choice))
        if found is not None and found[0]() is choice:
            return found[1]
        fingerprint = _fingerprint(choice)
        return _by_content.get(fingerprint) if fingerprint else None

    # -- history rows --------------------------------------------------------------------------------------

    def log_row(
        self, model: Model, row: dict[str, Any], groups: Sequence[TrajectoryGroup], config: BaseModel | None
    ) -> None:
        if self._unreachable and not self._warned:
            self._warned = True
            warn_user(
                f"artnb: Langfuse at {self.host} is unreachable or refused the keys ({self._unreachable}); "
                "traces are sent in the background and may be lost, training goes on (this warning is shown once)"
            )
        for g, group in enumerate(groups):
            for i, trajectory in enumerate(group.trajectories):
                self._trace(model, row, g, i, trajectory)

    def _trace(self, model: Model, row: dict[str, Any], g: int, i: int, trajectory: Trajectory) -> None:
        from langfuse import LangfuseGeneration, LangfuseSpan, propagate_attributes
        from opentelemetry import trace
        from opentelemetry.context import Context

        split, step = row.get("split"), row.get("step")
        name = f"{model.storage_name} {split} step {step}"
        turns = []  # (choice, the messages before it) of every trainable turn
        for history in trajectory.histories():
            for n, item in enumerate(history.messages_and_choices):
                if isinstance(item, Choice):
                    turns.append((item, history.messages_and_choices[:n]))
        calls = [self._call_for(choice) for choice, _ in turns]
        now = time.time_ns()
        tracer = self.client._otel_tracer  # spans with explicit start times: the SDK's own tracer
        root_span = tracer.start_span(
            name, context=Context(), start_time=min((c.start_ns for c in calls if c), default=now)
        )
        messages = trajectory.messages()
        first = next(
            (n for n, x in enumerate(trajectory.messages_and_choices) if isinstance(x, Choice)), None
        )
        root = LangfuseSpan(
            otel_span=root_span,
            langfuse_client=self.client,
            input=messages[:first] if first is not None else messages,
            output=messages[first:] if first is not None else None,
            metadata={
                "reward": trajectory.reward,
                "metrics": dict(trajectory.metrics),
                "metadata": dict(trajectory.metadata),
                "logs": list(trajectory.logs),
            },
        )
        short = {k: v for k, v in {**trajectory.metadata, **trajectory.metrics}.items() if len(str(v)) <= 100}
        labels = {
            "project": model.project,
            "model": model.name,
            "run": model.storage_name,
            "split": str(split),
            "step": step,
        }
        with (
            trace.use_span(root_span, end_on_exit=False),
            propagate_attributes(
                trace_name=name,
                tags=[str(split)],
                metadata={k: str(v) for k, v in {**short, **labels, "group": g, "trajectory": i}.items()},
            ),
        ):
            for (choice, before), call in zip(turns, calls, strict=True):
                span = tracer.start_span("chat completion", start_time=call.start_ns if call else now)
                generation = LangfuseGeneration(
                    otel_span=span,
                    langfuse_client=self.client,
                    model=call.model if call else _served_name(model, step),
                    input=call.input if call else [_message(x) for x in before],
                    output=choice_to_message(choice),
                    model_parameters=call.parameters if call else None,
                    usage_details=(call.usage or None) if call else None,
                    metadata={"finish_reason": choice.finish_reason, "recorded": call is not None},
                )
                generation.end(end_time=call.end_ns if call else now)
        root.end(end_time=now)
        self._score(root.trace_id, trajectory, split, step)

    def _score(self, trace_id: str, trajectory: Trajectory, split: Any, step: Any) -> None:
        where = {"split": split, "step": step}
        self.client.create_score(
            name="reward",
            value=float(trajectory.reward),
            trace_id=trace_id,
            data_type="NUMERIC",
            metadata=where,
        )
        for key, value in trajectory.metrics.items():
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            comment = trajectory.metadata.get("ruler_explanation") if key == "ruler_score" else None
            self.client.create_score(
                name=key,
                value=float(value),
                trace_id=trace_id,
                data_type="BOOLEAN" if isinstance(value, bool) else "NUMERIC",
                comment=str(comment) if comment else None,
                metadata=where,
            )

    # -- the rest ------------------------------------------------------------------------------------------

    def _find_project(self) -> None:
        """The project id names the traces page; failing to get it is also how a down host shows first."""
        try:
            projects = self.client.api.projects.get(request_options={"max_retries": 0}).data
        except Exception as error:
            self._unreachable = f"{type(error).__name__}: {error}"[:200]
            return
        if projects:
            self.url = f"{self.host}/project/{projects[0].id}/traces"

    def close(self) -> None:
        """Send what the SDK holds, waiting at most CLOSE_TIMEOUT_S (the SDK's own client stays usable)."""
        worker = threading.Thread(target=self.client.flush, name="artnb-langfuse-flush", daemon=True)
        worker.start()
        worker.join(CLOSE_TIMEOUT_S)


def _served_name(model: Model, step: Any) -> str:
    return model.get_inference_name(step if isinstance(step, int) else None)


def _message(item: Any) -> Any:
    return choice_to_message(item) if isinstance(item, Choice) else item


def _plain(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool)) else json.dumps(value, default=str)


def _fingerprint(choice: Choice) -> str | None:
    """What tells two completions apart once a Choice was copied (RULER copies its groups): the text, tool calls
    and sampled logprobs. None without logprobs: equal texts from different requests would be confused."""
    tokens = choice.logprobs.content if choice.logprobs and choice.logprobs.content else []
    if not tokens:
        return None
    return json.dumps(
        [choice_to_message(choice), choice.finish_reason, [(t.token, t.logprob) for t in tokens]],
        default=str,
    )
