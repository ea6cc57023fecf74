"""Forced tool calls, the same on both engines: what a request's `tool_choice` allows, and its grammar.

Why both engines share it: vLLM 0.32's own `tool_choice="required"` (with the hermes parser) constrains the
call's shape but not its arguments (measured: `{"name": "get_weather", "arguments": "Paris"}` against an object
schema), and its named tool choice makes the model write bare JSON arguments, which is not what the chat template
writes for that call in the next turn's prompt. So a forced call is decoded under one grammar on both engines:
Hermes blocks, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (one, or one or more when
`parallel_tool_calls` is not False), the arguments held to the tool's parameter schema. The HF engine compiles
it with xgrammar (hf/grammar.py); the vLLM middleware passes it as `structured_outputs.grammar` with tool choice
"auto", so vLLM's hermes parser turns the blocks into `tool_calls` (vllm/server.py).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

from artnb.backends.engines.json_grammar import json_schema_ebnf

_ROOT = re.compile(r"\broot\b")  # the JSON grammar's start rule ("root_prop_0" and the like do not match)


@dataclass
class ToolChoice:
    """What a request lets the model do with its tools.

    mode: "none" (no call is parsed), "auto" (calls the model writes are parsed), "required" (decoding is
    constrained to calls of `names`: one or more, or exactly one when `parallel` is False).
    """

    mode: str
    names: list[str]
    parallel: bool = True


def read_tool_choice(tools: list[dict[str, Any]] | None, choice: Any, parallel_tool_calls: Any) -> ToolChoice:
    """The request's tool choice, checked against its tools; raises ValueError naming the problem and the fix."""
    names = [_tool_name(i, tool) for i, tool in enumerate(tools or [])]
    parallel = parallel_tool_calls is not False
    if choice is None:
        return ToolChoice("auto" if names else "none", names, parallel)
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ValueError(
                f"tool_choice {choice!r} is not one of 'none', 'auto', 'required' or a named function"
            )
        if choice != "none" and not names:
            raise ValueError(f"tool_choice {choice!r} needs tools: pass tools=[...] or drop tool_choice")
        return ToolChoice(choice, names, parallel)
    name = None
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
    if not isinstance(name, str):
        raise ValueError(
            'a named tool_choice is {"type": "function", "function": {"name": "..."}}: fix tool_choice'
        )
    if name not in names:
        raise ValueError(f"tool_choice names {name!r}, which is not among the request's tools {names}")
    return ToolChoice("required", [name], parallel=False)


def _tool_name(index: int, tool: Any) -> str:
    function = (
        tool.get("function")
        if isinstance(tool, dict) and tool.get("type", "function") == "function"
        else None
    )
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError(
            f'tools[{index}] is not {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}'
        )
    return name


def call_schema(tools: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """The JSON schema of one call, `{"name": ..., "arguments": {...}}`, of any tool in `names`."""
    options = []
    for tool in tools:
        function = tool.get("function") or {}
        if function.get("name") in names:
            options.append(
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": function["name"]},
                        "arguments": function.get("parameters") or {"type": "object"},
                    },
                    "required": ["name", "arguments"],
                }
            )
    return options[0] if len(options) == 1 else {"anyOf": options}


def hermes_ebnf(schema: dict[str, Any], parallel: bool) -> str:
    """The EBNF grammar (xgrammar's dialect) of Hermes blocks holding calls that match `schema`.

    Raises ValueError when xgrammar cannot turn the schema into a grammar.
    """
    return _hermes_ebnf(
        json.dumps(schema), parallel
    )  # key order kept: it is the order the JSON is written in


@functools.lru_cache(maxsize=64)  # an agent forces the same tools request after request
def _hermes_ebnf(schema_json: str, parallel: bool) -> str:
    call = json_schema_ebnf(schema_json, what="the tools' parameter schemas")
    block = '"<tool_call>\\n" call "\\n</tool_call>"'
    more = f' ("\\n" {block})*' if parallel else ""
    return f"root ::= {block}{more}\n" + _ROOT.sub("call", call)


def forced_grammar(request: dict[str, Any]) -> str | None:
    """For a chat request (as JSON) that forces a tool call: the EBNF its output must follow; else None.

    Requests that also set an output constraint, or whose tools or tool choice are malformed, get None: the
    engine answers them itself.
    """
    constraints = ("structured_outputs", "guided_choice", "guided_json", "guided_regex", "guided_grammar")
    response_format = request.get("response_format")
    if any(request.get(k) is not None for k in constraints) or (
        isinstance(response_format, dict) and response_format.get("type", "text") != "text"
    ):
        return None
    try:
        choice = read_tool_choice(
            request.get("tools"), request.get("tool_choice"), request.get("parallel_tool_calls")
        )
        if choice.mode != "required":
            return None
        return hermes_ebnf(call_schema(request["tools"], choice.names), choice.parallel)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
