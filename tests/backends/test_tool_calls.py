"""Forced tool calls: what a tool_choice allows, and the grammar both engines decode a forced call under."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from artnb import models
from artnb.backends.engines.hf.grammar import GrammarCompiler, JsonConstraint
from artnb.backends.engines.tool_calls import call_schema, forced_grammar, read_tool_choice

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "get_time"}},
]


def test_tool_choice_modes_and_their_errors():
    assert read_tool_choice(TOOLS, None, None).mode == "auto"
    assert read_tool_choice(None, None, None).mode == "none"
    named = read_tool_choice(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None)
    assert (named.mode, named.names, named.parallel) == ("required", ["get_time"], False)
    assert read_tool_choice(TOOLS, "required", False).parallel is False
    with pytest.raises(ValueError, match="needs tools"):
        read_tool_choice([], "required", None)
    with pytest.raises(ValueError, match="not among the request's tools"):
        read_tool_choice(TOOLS, {"type": "function", "function": {"name": "nope"}}, None)
    with pytest.raises(ValueError, match=r"tools\[0\] is not"):
        read_tool_choice([{"type": "function"}], "auto", None)
    with pytest.raises(ValueError, match="'sometimes' is not one of"):
        read_tool_choice(TOOLS, "sometimes", None)


def test_forced_grammar_only_for_forced_calls_without_another_constraint():
    request = {"tools": TOOLS, "tool_choice": "required"}
    assert forced_grammar(request).startswith("root ::=")
    assert forced_grammar({**request, "tool_choice": "auto"}) is None
    assert forced_grammar({**request, "guided_json": {"type": "object"}}) is None
    assert forced_grammar({**request, "response_format": {"type": "json_object"}}) is None
    assert forced_grammar({**request, "response_format": {"type": "text"}}) is not None
    assert forced_grammar({**request, "tool_choice": {"type": "function", "function": {"name": "x"}}}) is None


def accepts(tokenizer, grammar, text: str) -> bool:
    constraint = JsonConstraint(grammar)
    ok = all(constraint.matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
    return (
        ok and constraint.matcher.accept_token(tokenizer.eos_token_id) and constraint.matcher.is_terminated()
    )


def test_the_grammar_holds_the_arguments_to_the_schema_and_allows_parallel_calls():
    tokenizer = AutoTokenizer.from_pretrained(models.tiny())
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    time = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    one = compiler.compile_tool_calls(call_schema(TOOLS, ["get_weather"]), parallel=False)
    assert accepts(tokenizer, one, call)
    assert not accepts(
        tokenizer, one, call.replace('{"city": "Paris"}', '"Paris"')
    )  # vLLM's own let this pass
    assert not accepts(tokenizer, one, call + "\n" + call)
    several = compiler.compile_tool_calls(call_schema(TOOLS, ["get_weather", "get_time"]), parallel=True)
    assert accepts(tokenizer, several, call + "\n" + time)
