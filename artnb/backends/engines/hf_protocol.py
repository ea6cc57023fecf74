"""The OpenAI wire format as the HF engine speaks it: request models, errors, messages and tool calls.

Requests are validated by pydantic; unknown fields are ignored (as vLLM does), but fields whose silent
omission would change results (streaming, response_format, structured outputs other than `choice`) are
rejected by the server with a message saying what to use instead. Errors use OpenAI's body
`{"error": {"message", "type", "code"}}`, so the openai client raises them with the message intact.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class EngineError(Exception):
    """An error the client caused, returned as an OpenAI-style error body with this HTTP status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    messages: list[dict[str, Any]] = Field(min_length=1)
    model: str
    n: int = Field(1, ge=1, le=256)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    logprobs: bool | None = None  # accepted; logprobs are always returned
    top_logprobs: int | None = Field(None, ge=0, le=20)
    min_tokens: int = Field(0, ge=0)  # vLLM's extra parameter: no EOS before this many tokens
    stream: bool | None = None
    guided_choice: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class LoadAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI message as chat templates expect it: text content, tool-call arguments as dicts."""
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


def parse_tool_calls(text: str) -> tuple[list[dict[str, Any]], str]:
    """Hermes-style `<tool_call>{"name": .., "arguments": {..}}</tool_call>` blocks -> OpenAI tool_calls."""
    calls, rest, end = [], [], 0
    for match in _TOOL_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
            name, arguments = call["name"], call.get("arguments", {})
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
        rest.append(text[end : match.start()])
        end = match.end()
        arguments = arguments if isinstance(arguments, str) else json.dumps(arguments)
        calls.append(
            {
                "id": f"call_{secrets.token_hex(12)}",
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        )
    rest.append(text[end:])
    return calls, "".join(rest).strip()


def error_response(status: int, message: str) -> JSONResponse:
    kind = {401: "authentication_error", 404: "not_found_error"}.get(status, "invalid_request_error")
    kind = "internal_error" if status >= 500 else kind
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)
