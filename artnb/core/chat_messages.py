"""Messages as chat templates read them: the one rendering the HF engine applies to a request and the trainer to
a history, so that both turn a message into the same tokens.

Its own module, importing nothing heavy: the engine server imports it at every start (core/trajectory.py
imports the OpenAI SDK's types, about 1.5 s of an engine's 11 s of imports on this CPU).
"""

from __future__ import annotations

import json
from typing import Any


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI message as chat templates expect it: text content (None as "", a list of parts as its text),
    tool-call arguments as dicts. The HF engine renders requests with it and the trainer the history, so both
    render a message alike (vLLM parses tool-call arguments too)."""
    message = dict(message)
    content = message.get("content")
    if content is None:
        message["content"] = ""
    elif isinstance(content, list):
        message["content"] = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    if message.get("tool_calls"):
        calls = []
        for call in message["tool_calls"]:
            call = json.loads(json.dumps(call))
            function = call.get("function", {})
            if isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except json.JSONDecodeError:
                    pass
            calls.append(call)
        message["tool_calls"] = calls
    return message
