"""OpenAI Responses-API and Anthropic Messages exchanges as chat messages, so that capture records them too.

Why: an agent written with the OpenAI Agents SDK (Responses API by default) or the Anthropic SDK against an
engine that serves those routes (vLLM serves `/v1/responses` and `/v1/messages`) keeps its history in that API's
shape. Capture (capture.py) and the trainer work on chat messages, so each exchange is translated once, here:
the request becomes the chat `messages` and `tools` it stands for, the response the chat `Choice` it stands for
(text, tool calls, finish reason, and the sampled tokens' logprobs and ids where the server returned them).

What maps to what:
- Responses: `instructions` -> a system message; `input` text or items: messages (text parts joined;
  `developer` -> `system`), `function_call` -> an assistant tool call, `function_call_output` -> a tool message;
  reasoning and built-in tool items are left out (they are not text a chat template renders). Function tools ->
  chat tools. Output: `output_text` parts and `function_call` items; the sampled tokens' logprobs and ids when
  `include=["message.output_text.logprobs"]` was asked of a vLLM started with `--return-tokens-as-token-ids`.
- Messages: `system` -> a system message; text blocks joined; `tool_use` -> an assistant tool call (its `input`
  as JSON arguments); `tool_result` -> a tool message; tools' `input_schema` -> chat `parameters`;
  `stop_reason` -> finish reason.

A turn without sampled token ids (Anthropic's API has none; a Responses call without them) is recorded as a
Choice without logprobs: it trains only with `allow_training_without_logprobs=True`, which the trainer's error
names.
"""

from __future__ import annotations

import json
import re
import warnings
from typing import Any

_TOKEN_ID = re.compile(r"token_id:\d+")
_NO_TOKEN_IDS = (
    "artnb: a Responses-API turn was captured without its sampled token ids, so it trains only with "
    "allow_training_without_logprobs=True (its text re-tokenised, importance ratio 1). For the exact tokens, "
    'ask for include=["message.output_text.logprobs"] from a vLLM started with --return-tokens-as-token-ids '
    '(LocalBackend(engine_options={"extra_args": ["--return-tokens-as-token-ids"]}))'
)
_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls"}


def _text(content: Any) -> str:
    """The text of a content value: a string, or a list of parts/blocks (their `text`, in order)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return ""


def _tool_call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _add_call(messages: list[dict[str, Any]], call: dict[str, Any]) -> None:
    """A tool call joins the assistant message just before it (one reply, several calls), else starts one."""
    if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
        messages[-1]["tool_calls"].append(call)
    elif messages and messages[-1]["role"] == "assistant":
        messages[-1]["tool_calls"] = [call]
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _choice(
    text: str, calls: list[dict[str, Any]], finish: str, logprobs: list[dict] | None
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "message": message}
    if logprobs:
        choice["logprobs"] = {"content": logprobs}
    return choice


# OpenAI Responses API ---------------------------------------------------------------------------------------


def responses_messages(request: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages a Responses-API request's `instructions` and `input` stand for."""
    messages: list[dict[str, Any]] = []
    if request.get("instructions"):
        messages.append({"role": "system", "content": _text(request["instructions"])})
    items = request.get("input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    for item in items or []:
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item.get("role") == "developer" else item.get("role", "user")
            messages.append({"role": role, "content": _text(item.get("content"))})
        elif kind == "function_call":
            _add_call(
                messages, _tool_call(item.get("call_id", ""), item.get("name", ""), item.get("arguments"))
            )
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {"role": "tool", "tool_call_id": item.get("call_id", ""), "content": _text(output)}
            )
    return messages


def responses_tools(request: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Function tools as chat tools; built-in tools (web search, files) have no chat form and are left out."""
    tools = [
        {
            "type": "function",
            "function": {
                key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None
            },
        }
        for tool in request.get("tools") or []
        if isinstance(tool, dict) and tool.get("type") == "function"
    ]
    return tools or None


def responses_choice(response: dict[str, Any]) -> dict[str, Any]:
    """The chat Choice (as JSON) a Responses-API response stands for.

    Its logprobs are kept only when their tokens name the sampled ids (`token_id:N`, vLLM's
    `--return-tokens-as-token-ids`): the trainer must not re-tokenise text. Without them the turn is recorded
    without logprobs, with a warning that says how to get them.
    """
    text, calls, logprobs = [], [], []
    for item in response.get("output") or []:
        if item.get("type") == "message":
            for part in item.get("content") or []:
                if part.get("type") == "output_text":
                    text.append(part.get("text") or "")
                    logprobs.extend(part.get("logprobs") or [])
        elif item.get("type") == "function_call":
            calls.append(_tool_call(item.get("call_id", ""), item.get("name", ""), item.get("arguments")))
    incomplete = (response.get("incomplete_details") or {}).get("reason")
    finish = "length" if incomplete == "max_output_tokens" else "tool_calls" if calls else "stop"
    if not all(_TOKEN_ID.fullmatch(str(p.get("token"))) for p in logprobs):
        logprobs = []
    if text and not logprobs:
        warnings.warn(_NO_TOKEN_IDS, stacklevel=4)
    return _choice("".join(text), calls, finish, logprobs)


def response_from_events(body: bytes) -> dict[str, Any]:
    """The Response a whole Responses-API event stream ends with (its `response.completed` event)."""
    for event in _events(body):
        if event.get("type") in ("response.completed", "response.incomplete"):
            return event["response"]
        if event.get("type") in ("response.failed", "error"):
            raise ValueError(f"the stream ended with an error: {event}")
    raise ValueError("the stream has no response.completed event")


# Anthropic Messages API -------------------------------------------------------------------------------------


def anthropic_messages(request: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages an Anthropic Messages request's `system` and `messages` stand for."""
    messages: list[dict[str, Any]] = []
    if request.get("system"):
        messages.append({"role": "system", "content": _text(request["system"])})
    for message in request.get("messages") or []:
        content = message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
        text = "".join(b.get("text") or "" for b in blocks if b.get("type") == "text")
        if message.get("role") == "assistant":
            messages.append({"role": "assistant", "content": text or None})
            for block in blocks:
                if block.get("type") == "tool_use":
                    _add_call(
                        messages, _tool_call(block.get("id", ""), block.get("name", ""), block.get("input"))
                    )
            continue
        for block in blocks:  # tool results answer the previous reply's calls, before any new user text
            if block.get("type") == "tool_result":
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": block.get("tool_use_id", ""),
                        "content": _text(block.get("content")),
                    }
                )
        if text or not any(b.get("type") == "tool_result" for b in blocks):
            messages.append({"role": message.get("role", "user"), "content": text})
    return messages


def anthropic_tools(request: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": tool["name"],
                **({"description": tool["description"]} if tool.get("description") else {}),
                "parameters": tool.get("input_schema") or {"type": "object", "properties": {}},
            },
        }
        for tool in request.get("tools") or []
        if isinstance(tool, dict) and tool.get("name") and tool.get("type", "custom") == "custom"
    ]
    return tools or None


def anthropic_choice(message: dict[str, Any]) -> dict[str, Any]:
    """The chat Choice (as JSON) an Anthropic Message stands for."""
    blocks = message.get("content") or []
    text = "".join(b.get("text") or "" for b in blocks if b.get("type") == "text")
    calls = [
        _tool_call(b.get("id", ""), b.get("name", ""), b.get("input") or {})
        for b in blocks
        if b.get("type") == "tool_use"
    ]
    finish = _FINISH.get(message.get("stop_reason") or "", "tool_calls" if calls else "stop")
    return _choice(text, calls, finish, None)


def message_from_events(body: bytes) -> dict[str, Any]:
    """The Message a whole Anthropic event stream adds up to (message_start, content blocks, message_delta)."""
    message: dict[str, Any] | None = None
    partial: dict[int, str] = {}  # a tool_use block's input, as JSON text arriving in pieces
    stopped = False
    for event in _events(body):
        kind = event.get("type")
        if kind == "message_start":
            message = {**event["message"], "content": list(event["message"].get("content") or [])}
        elif message is None:
            continue
        elif kind == "content_block_start":
            message["content"].append(dict(event["content_block"]))
        elif kind == "content_block_delta":
            block, delta = message["content"][event["index"]], event["delta"]
            if delta.get("type") == "text_delta":
                block["text"] = (block.get("text") or "") + delta.get("text", "")
            elif delta.get("type") == "input_json_delta":
                partial[event["index"]] = partial.get(event["index"], "") + delta.get("partial_json", "")
        elif kind == "message_delta":
            message.update({k: v for k, v in (event.get("delta") or {}).items() if v is not None})
        elif kind == "message_stop":
            stopped = True
        elif kind == "error":
            raise ValueError(f"the stream ended with an error: {event.get('error')}")
    if message is None or not stopped:
        raise ValueError("the stream ended before message_stop")
    for index, text in partial.items():
        message["content"][index]["input"] = json.loads(text) if text else {}
    return message


def _events(body: bytes) -> list[dict[str, Any]]:
    """The JSON `data:` payloads of a server-sent-event body, in order (the event name is in each `type`)."""
    events = []
    for line in body.decode().splitlines():
        if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
            value = json.loads(line[5:])
            if isinstance(value, dict):
                events.append(value)
    return events
