"""ART's `art.utils.format_message`: one chat message as readable text, for printing a rollout."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def format_message(message: Mapping[str, Any]) -> str:
    """The role (capitalised, with a colon) on its own line, then the content (or the refusal), then one `name(arguments)` line per tool call.

    >>> print(format_message({"role": "user", "content": "Hi"}))
    User:
    Hi
    """
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise TypeError(
            f"format_message takes an OpenAI message dict with a 'role' (got {message!r:.80}); for a Choice "
            "pass choice.message.model_dump()"
        )
    text = message.get("content") or message.get("refusal") or ""
    if not isinstance(text, str):  # content parts: keep their text
        text = "".join(p.get("text", "") for p in text if isinstance(p, Mapping))
    lines = [f"{message['role'].capitalize()}:", text] if text else [f"{message['role'].capitalize()}:"]
    lines += [_call_line(call) for call in message.get("tool_calls") or [] if _function(call) is not None]
    return "\n".join(lines)


def _function(call: Any) -> Mapping[str, Any] | None:
    function = call.get("function") if isinstance(call, Mapping) else None
    return function if isinstance(function, Mapping) else None


def _call_line(call: Mapping[str, Any]) -> str:
    function = _function(call) or {}
    return f"{function.get('name')}({function.get('arguments')})"
