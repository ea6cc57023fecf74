"""Turn a litellm `Choices` into the OpenAI `Choice` a trajectory trains on.

Rollouts written against litellm (`await litellm.acompletion(**model.litellm_completion_params(), ...)`) get
litellm's own response types. A trainable turn in `Trajectory.messages_and_choices` must be an OpenAI `Choice`
carrying the sampled tokens' logprobs, so the rollout appends
`convert_litellm_choice_to_openai(response.choices[0])`.

Same call as OpenPipe ART's `art.utils.litellm.convert_litellm_choice_to_openai`: content, tool calls,
finish reason, index and logprobs (with top alternatives) are carried over; litellm's extras (reasoning text,
provider fields) are not. Departures: wrong input raises ValueError saying what to pass (ART uses `assert`,
which `python -O` skips); logprobs that litellm left as a plain dict are converted too; `refusal` is kept.
litellm is never imported here (importing it is slow and, without LITELLM_LOCAL_MODEL_COST_MAP, goes to the
network), so any object with litellm's attribute names works.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from openai.types.chat.chat_completion import Choice

if TYPE_CHECKING:
    from litellm.types.utils import Choices


def convert_litellm_choice_to_openai(choice: Choices) -> Choice:
    """The OpenAI `Choice` for a litellm choice (an assistant turn), logprobs included.

    >>> response = await litellm.acompletion(**model.litellm_completion_params(), messages=traj.messages(), logprobs=True)
    >>> traj.messages_and_choices.append(convert_litellm_choice_to_openai(response.choices[0]))
    """
    message = getattr(choice, "message", None)
    if message is None:
        raise ValueError(
            f"expected a litellm choice with a .message (response.choices[0] from litellm.acompletion), got "
            f"{type(choice).__name__}; a streamed response must be assembled first (litellm.stream_chunk_builder)"
        )
    role = getattr(message, "role", None)
    if role != "assistant":
        raise ValueError(
            f"only assistant turns become trainable Choices, but this message's role is {role!r}; append it to "
            "messages_and_choices as a message dict instead"
        )
    body: dict[str, Any] = {"role": "assistant", "content": getattr(message, "content", None)}
    if getattr(message, "refusal", None):
        body["refusal"] = message.refusal
    tool_calls = getattr(message, "tool_calls", None)
    if tool_calls:
        body["tool_calls"] = [_tool_call(call, i) for i, call in enumerate(tool_calls)]
    return Choice.model_validate(
        {
            "index": getattr(choice, "index", 0) or 0,
            "finish_reason": getattr(choice, "finish_reason", None) or "stop",
            "message": body,
            "logprobs": _logprobs(getattr(choice, "logprobs", None)),
        }
    )


def _tool_call(call: Any, position: int) -> dict[str, Any]:
    call = _as_dict(call)
    function = _as_dict(call.get("function") or {})
    if call.get("type", "function") != "function":
        raise ValueError(
            f"tool call {position} has type {call.get('type')!r}; only function tool calls can be trained on"
        )
    if not function.get("name"):
        raise ValueError(f"tool call {position} has no function name, so it cannot be replayed or trained on")
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {"name": function["name"], "arguments": function.get("arguments") or ""},
    }


def _logprobs(logprobs: Any) -> dict[str, Any] | None:
    if logprobs is None:
        return None
    data = _as_dict(logprobs)
    if "content" not in data:
        raise ValueError(
            f"the choice's logprobs ({type(logprobs).__name__}) have no 'content' list of token logprobs; "
            "request chat-style logprobs (logprobs=True) from the server"
        )
    return data


def _as_dict(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    if hasattr(value, "model_dump"):
        return value.model_dump()
    return dict(vars(value))
