"""Grammar-constrained decoding for the HF engine, per row: JSON (`response_format`, `structured_outputs.json`)
and forced tool calls (`tool_choice` "required" or a named function).

Why xgrammar: it is what vLLM uses for the same requests, so a schema that works on one engine works on the
other; it runs on CPU (a C++ matcher and a CPU bitmask kernel); and it compiles a schema once for the
tokenizer, after which each decoding step costs one bitmask fill per constrained row.

Design choices:
- One `GrammarMatcher` per row, advanced with the row's own sampled tokens, so rows with different schemas (or
  none) share a batch without affecting each other.
- Whitespace between JSON tokens is fixed (`any_whitespace=False`): small models otherwise loop on newlines
  and spaces until max_tokens. The output is ordinary JSON with `", "` and `": "` separators.
- Schemas are compiled from json_grammar.py's EBNF, which repairs xgrammar's length-bounded strings (they admit
  raw control characters, so the output would not be JSON).
- A forced tool call is constrained to Hermes blocks whose arguments follow the tool's parameter schema
  (tool_calls.py, the same grammar the vLLM engine is given).
- The compiler (xgrammar import, tokenizer vocabulary scan) is built on the first JSON request, not at engine
  start, and compiled grammars are kept by their EBNF text, so repeating a schema costs nothing.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from artnb.backends.engines.json_grammar import json_schema_ebnf
from artnb.backends.engines.tool_calls import hermes_ebnf

ANY_OBJECT = {"type": "object"}  # what `response_format: {"type": "json_object"}` allows


class JsonConstraint:
    """A row's grammar state: which tokens may come next, advanced with each sampled token."""

    def __init__(self, compiled: Any):
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled)

    def accept(self, token: int) -> None:
        if not self.matcher.is_terminated():
            self.matcher.accept_token(token)


def mask_logits(logits: torch.Tensor, constraints: list[JsonConstraint | None]) -> None:
    """Set to -inf, in place, every logit the row's grammar forbids next (rows without a grammar untouched)."""
    rows = [j for j, c in enumerate(constraints) if c is not None]
    if not rows:
        return
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(constraints), logits.shape[-1])
    for j, constraint in enumerate(constraints):
        if constraint is not None:
            constraint.matcher.fill_next_token_bitmask(bitmask, j)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)


class GrammarCompiler:
    """Compiles JSON schemas for one tokenizer; thread-safe, built on first use."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int]):
        self._tokenizer, self._vocab_size, self._stop_ids = tokenizer, vocab_size, stop_ids
        self._compiler: Any = None
        self._compiled: dict[str, Any] = {}  # compiled grammars by their EBNF text, oldest first
        self._lock = threading.Lock()

    def _get(self) -> Any:
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar
                except ImportError as error:
                    raise RuntimeError(
                        "JSON-constrained output needs the xgrammar package: pip install xgrammar"
                    ) from error
                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_ids
                )
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, schema: dict[str, Any] | None) -> Any:
        """A compiled grammar for `schema`, or for any JSON object when schema is None.

        Raises ValueError naming the problem when xgrammar cannot compile the schema.
        """
        return self._compile(json_schema_ebnf(schema or ANY_OBJECT), "the JSON schema")

    def compile_tool_calls(self, call_schema: dict[str, Any], parallel: bool) -> Any:
        """A compiled grammar for one (or, if `parallel`, one or more) Hermes tool-call blocks (tool_calls.py).

        Raises ValueError naming the problem when a tool's parameter schema cannot be compiled.
        """
        return self._compile(hermes_ebnf(call_schema, parallel), "the tools' parameter schemas")

    def _compile(self, ebnf: str, what: str) -> Any:
        compiled = self._compiled.get(ebnf)  # an agent sends the same schema or tools request after request
        if compiled is not None:
            return compiled
        import xgrammar

        try:
            compiled = self._get().compile_grammar(xgrammar.Grammar.from_ebnf(ebnf))
        except Exception as error:  # xgrammar raises RuntimeError/ValueError subclasses of its own
            raise ValueError(f"{what} could not be compiled: {error}") from error
        with self._lock:
            if len(self._compiled) >= 64:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[ebnf] = compiled
        return compiled
