"""The OpenAI wire format as the HF engine speaks it: request models, errors, messages and tool calls.

Requests are validated by pydantic; unknown fields are ignored (as vLLM does), but fields whose silent
omission would change results (structured outputs other than choice and JSON, `logit_bias`) are rejected by the
server with a message saying what to use instead. `tool_choice` reads what a request lets the model do with its
tools (tool_calls.py holds the forced calls' grammar, shared with the vLLM engine). `structured_output` reads the three spellings of a
constraint (OpenAI's `response_format`, vLLM's `structured_outputs` and `guided_choice`) into one. A
request's own chat template (`chat_template`, or `chat_template_kwargs.chat_template`) is refused unless the
server was started to trust them, as vLLM does. Errors use OpenAI's body `{"error": {"message", "type",
"code"}}` (`guard.error_body`, shared with the auth layer), so the openai client raises them with the message
intact.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from artnb.backends.engines.guard import error_body
from artnb.backends.engines.tool_calls import ToolChoice, read_tool_choice

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
    n: int = Field(default=1, ge=1, le=256)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # read by tool_choice() below
    parallel_tool_calls: bool | None = None  # None or True: a forced call may be several calls
    logprobs: bool | None = None  # accepted; logprobs are always returned
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # refused unless empty (see sampling_refusals)
    min_tokens: int = Field(default=0, ge=0)  # vLLM's extra parameter: no EOS before this many tokens
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None  # include_usage: a last chunk with the usage
    guided_choice: list[str] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's field; refused unless the server trusts request templates
    chat_template_kwargs: dict[str, Any] | None = (
        None  # passed to apply_chat_template (its `chat_template` too)
    )


class CompletionRequest(BaseModel):
    """`POST /v1/completions`: a prompt in (text or token ids), text out, no chat template."""

    model_config = ConfigDict(extra="ignore")

    model: str
    prompt: str | list[int] | list[str] | list[list[int]]
    n: int = Field(default=1, ge=1, le=256)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for this endpoint
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = Field(default=None, ge=0, le=20)  # the legacy API's top-k count
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    min_tokens: int = Field(default=0, ge=0)
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None


def sampling_refusals(request: ChatRequest | CompletionRequest) -> None:
    """Raise EngineError (400) for settings the HF engine would otherwise ignore and so change results."""
    if request.logit_bias:
        raise EngineError(
            400,
            "logit_bias is not supported by the HF engine: drop it (or use vLLM, LocalBackend(engine='vllm'))",
        )
    if isinstance(request, CompletionRequest):
        if request.echo:
            raise EngineError(
                400, "echo is not supported by the HF engine: drop it and prepend the prompt yourself"
            )
        if request.suffix:
            raise EngineError(400, "suffix (insertion) is not supported by the HF engine: drop it")
        if request.best_of is not None and request.best_of != request.n:
            raise EngineError(
                400, "best_of is not supported by the HF engine: use n and pick the best yourself"
            )
        if isinstance(request.prompt, list) and request.prompt and isinstance(request.prompt[0], (str, list)):
            if len(request.prompt) != 1:
                raise EngineError(
                    400, "the HF engine takes one prompt per request: send one request per prompt"
                )


def tool_choice(request: ChatRequest) -> ToolChoice:
    """The request's tool choice, checked against its tools; raises EngineError (400) naming the problem."""
    try:
        return read_tool_choice(request.tools, request.tool_choice, request.parallel_tool_calls)
    except ValueError as error:
        raise EngineError(400, str(error)) from None


@dataclass
class StructuredOutput:
    """What a request constrains its output to: one of `choices`, or JSON (`schema` None: any object)."""

    choices: list[str] | None = None
    json: bool = False
    schema: dict[str, Any] | None = None


def structured_output(request: ChatRequest) -> StructuredOutput | None:
    """The request's output constraint, or None; raises EngineError (400) for what is unsupported or ambiguous."""
    found: list[tuple[str, StructuredOutput]] = []
    if request.guided_regex is not None or request.guided_grammar is not None:
        raise EngineError(
            400,
            "guided_regex and guided_grammar are not supported by the HF engine: use guided_choice or a JSON "
            "schema (or vLLM, LocalBackend(engine='vllm'), for regex and grammars)",
        )
    if request.guided_choice is not None:
        found.append(("guided_choice", StructuredOutput(choices=request.guided_choice)))
    if request.guided_json is not None:
        found.append(
            ("guided_json", StructuredOutput(json=True, schema=_schema("guided_json", request.guided_json)))
        )
    rf = request.response_format or {}
    kind = rf.get("type", "text")
    if kind == "json_object":
        found.append(("response_format", StructuredOutput(json=True)))
    elif kind == "json_schema":
        spec = rf.get("json_schema") or {}
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise EngineError(
                400,
                "response_format json_schema needs a schema: pass "
                '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
            )
        found.append(("response_format", StructuredOutput(json=True, schema=schema)))
    elif kind != "text":
        raise EngineError(
            400, f"response_format type {kind!r} is not supported: use 'text', 'json_object' or 'json_schema'"
        )
    so = {k: v for k, v in (request.structured_outputs or {}).items() if v is not None and v is not False}
    unsupported = sorted(set(so) - {"choice", "json", "json_object"})
    if unsupported:
        raise EngineError(
            400,
            f"structured_outputs {unsupported} not supported by the HF engine: use 'choice', 'json' or "
            "'json_object' (or vLLM, LocalBackend(engine='vllm'), for regex and grammars)",
        )
    if "choice" in so:
        found.append(("structured_outputs.choice", StructuredOutput(choices=list(so["choice"]))))
    if "json" in so:
        schema = _schema("structured_outputs.json", so["json"])
        found.append(("structured_outputs.json", StructuredOutput(json=True, schema=schema)))
    if "json_object" in so:
        found.append(("structured_outputs.json_object", StructuredOutput(json=True)))
    if len(found) > 1:
        raise EngineError(
            400, f"the request sets {[name for name, _ in found]}: pass only one output constraint"
        )
    if not found:
        return None
    name, out = found[0]
    if out.choices is not None and not out.choices:
        raise EngineError(400, f"{name} is empty: pass at least one allowed string")
    return out


def _schema(field: str, value: Any) -> dict[str, Any]:
    """A JSON schema given as an object or as a JSON string (vLLM accepts both)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise EngineError(400, f"{field} is not valid JSON: {error}") from error
    if not isinstance(value, dict):
        raise EngineError(400, f"{field} must be a JSON schema object, got {type(value).__name__}")
    return value


class LoadAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)


class DefaultsRequest(BaseModel):
    """`POST /artnb/defaults`: what a request that names no temperature samples at (None: 1)."""

    temperature: float | None = Field(default=None, ge=0, le=2)


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
    return calls, "".join(rest)


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status)
