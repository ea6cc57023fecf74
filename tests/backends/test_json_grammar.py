"""JSON-schema grammars: a length-bounded string still yields JSON, on both engines' paths."""

from __future__ import annotations

import json

import pytest
import xgrammar

from artnb.backends.engines.json_grammar import json_schema_ebnf, needs_repair, repair_json_request

BOUNDED = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"]}
FREE = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def accepts(ebnf: str, document: str) -> bool:
    compiled = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo([])).compile_grammar(ebnf)
    matcher = xgrammar.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(document) and matcher.is_terminated()


@pytest.mark.parametrize("any_whitespace", [False, True])
def test_a_length_bounded_string_admits_only_json(any_whitespace):
    ebnf = json_schema_ebnf(BOUNDED, any_whitespace)
    assert not accepts(ebnf, '{"name": "ab\x0cc"}'), "a raw control character is not JSON"
    assert not accepts(ebnf, '{"name": "a\tb"}')
    for value in ["abcdef", "é ü 字", ""]:
        document = json.dumps({"name": value}, ensure_ascii=False)
        assert accepts(ebnf, document), document
    assert not accepts(ebnf, json.dumps({"name": "abcdefg"})), "maxLength still holds"
    # As in xgrammar's own grammar, a bounded string holds no escapes: one character class keeps decoding fast.
    assert not accepts(ebnf, json.dumps({"name": 'a"b'}))


def test_schemas_without_bounded_strings_keep_xgrammars_grammar():
    assert not needs_repair(FREE, any_whitespace=False)
    assert json_schema_ebnf(FREE) == str(
        xgrammar.Grammar.from_json_schema(json.dumps(FREE), any_whitespace=False)
    )
    assert needs_repair(BOUNDED, any_whitespace=True)
    with pytest.raises(ValueError, match="the JSON schema could not be compiled.*objekt"):
        json_schema_ebnf({"type": "objekt"})


def test_vllm_requests_get_the_repaired_grammar_only_where_needed():
    request = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BOUNDED}}}
    assert repair_json_request(request)
    assert "response_format" not in request
    assert request["structured_outputs"]["grammar"] == json_schema_ebnf(BOUNDED, any_whitespace=True)

    legacy = {"structured_outputs": {"json": json.dumps(BOUNDED), "disable_any_whitespace": True}}
    assert repair_json_request(legacy)
    assert legacy["structured_outputs"] == {
        "disable_any_whitespace": True,
        "grammar": json_schema_ebnf(BOUNDED, any_whitespace=False),
    }
    for untouched in [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": FREE}}},
        {"response_format": {"type": "json_object"}},
        {"structured_outputs": {"json": "{not json"}},
        {"structured_outputs": {"json": {"type": "objekt"}}},
        {"messages": []},
    ]:
        before = json.dumps(untouched)
        assert not repair_json_request(untouched)
        assert json.dumps(untouched) == before
