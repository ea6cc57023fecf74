"""`art.langgraph`: a LangGraph (or any LangChain) agent whose chat model is the policy, trained from its calls.

Why it is this small: the calls a LangGraph agent makes go through LangChain's `ChatOpenAI`, which sends them with
the OpenAI SDK, so the capture scope (core/capture.py) records each one as the engine answered it: the messages
LangChain sent (tool calls and tool results included) and the reply with its sampled token ids. The trainer then
trains exactly the tokens the model sampled. ART instead logs LangChain's message objects and converts them back
to text, which the trainer must re-tokenise, and replays each call through a wrapper that drops options such as
`with_retry`; here `init_chat_model` returns a plain `ChatOpenAI`, so every LangChain feature works as documented.

    from artnb.langgraph import init_chat_model, wrap_rollout

    async def rollout(scenario) -> art.Trajectory:      # ART's shape: return a Trajectory, or just the reward
        agent = create_react_agent(init_chat_model(), tools)
        result = await agent.ainvoke({"messages": [("user", scenario.question)]})
        return art.Trajectory(reward=score(result), messages_and_choices=[])

    group = await art.gather_trajectory_groups([art.TrajectoryGroup(wrap_rollout(model, rollout)(s) for _ in range(4))])

Needs `langchain-openai` (`pip install artnb[langgraph]`, which also brings `langgraph`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from contextvars import ContextVar
from typing import Any

from .core.capture import trajectory
from .core.model import Model
from .core.trajectory import Trajectory

_model: ContextVar[Model | None] = ContextVar("artnb_langgraph_model", default=None)


def init_chat_model(
    model: Model | str | None = None,
    *,
    model_provider: str | None = None,
    configurable_fields: Any = None,
    config_prefix: str | None = None,
    **kwargs: Any,
) -> Any:
    """A LangChain `ChatOpenAI` that calls `model` (by default the model of the enclosing `wrap_rollout`).

    A string (ART's notebooks pass `model.get_inference_name()`) names what to request, e.g. `"agent@3"`, from
    the enclosing `wrap_rollout`'s model. `kwargs` go to ChatOpenAI (`max_tokens`, `seed`, `timeout`...); temperature defaults to 1.0, the sampling
    the policy is trained under. `model_provider`, `configurable_fields` and `config_prefix` are LangChain's
    `init_chat_model` arguments, accepted for ART's calls and ignored: the provider is the policy's engine.
    """
    try:
        from langchain_openai import ChatOpenAI
    except ImportError as error:
        raise ImportError(
            "art.langgraph needs LangChain's OpenAI chat model: pip install 'artnb[langgraph]'"
        ) from error
    name = model if isinstance(model, str) else None
    if model is None or name is not None:
        model = _model.get()
    if model is None:
        raise RuntimeError(
            f"init_chat_model({'' if name is None else repr(name)}) must run inside a rollout wrapped by "
            "art.langgraph.wrap_rollout(model, rollout); or pass the model: init_chat_model(model)"
        )
    if not isinstance(model, Model):
        raise TypeError(
            f"init_chat_model takes an art.Model, a TrainableModel or a served model's name, got {type(model).__name__}"
        )
    client = model.openai_client()  # raises with the fix when the model is not registered
    return ChatOpenAI(
        **{
            "model": name or model.get_inference_name(),
            "base_url": str(client.base_url),
            "api_key": client.api_key,
            "temperature": 1.0,
            **kwargs,
        }
    )


def wrap_rollout(
    model: Model, fn: Callable[..., Coroutine[Any, Any, Any]]
) -> Callable[..., Coroutine[Any, Any, Trajectory]]:
    """`fn` as a rollout whose chat calls (through `init_chat_model()` or any OpenAI client) become its
    Trajectory's turns.

    `fn` may return a Trajectory (ART's shape: its reward, metrics and metadata are kept, its histories are the
    captured calls), a number (the reward) or None (then set `art.current_trajectory().reward`).
    """

    @functools.wraps(fn)
    async def rollout(*args: Any, **kwargs: Any) -> Trajectory:
        token = _model.set(model)
        try:
            return await trajectory(fn(*args, **kwargs), take_calls=True)
        finally:
            _model.reset(token)

    return rollout
