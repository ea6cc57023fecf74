"""Streamed responses of the HF engine: OpenAI's server-sent events, sent while the rows are being sampled.

Why its own module: a stream is the non-streamed response cut into pieces as tokens arrive, and the hard part
is deciding which text is final. Design choices:
- The decoding thread calls each row's `on_token`, which only wakes the event loop; the stream then sends every
  row's new tokens as one chunk: the text they completed, their logprobs and their `token_ids`. The first
  chunk carries `prompt_token_ids`, so a streamed rollout trains on exactly the sampled tokens, as a
  non-streamed one does.
- Text is sent only once no later token can change it: an incomplete UTF-8 character at the end, the beginning
  of a stop string, and, when tools may be called, anything from `<tool_call>` on wait for more tokens. When a
  row finishes, the rest of its content and its tool calls come from the same `choice_json` as the
  non-streamed response, so the chunks add up to exactly the non-streamed message.
- A tool call is sent as OpenAI's deltas: its id, type and name first, then its arguments.
- `stream_options.include_usage` adds a last chunk with no choices and the usage.
- The text work (decoding token ids) runs on the server's prep thread, like all tokenizer work.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from typing import Any, Protocol

from artnb.backends.engines.hf.batching import Row

TOOL_CALL_START = "<tool_call>"


class ChoiceSource(Protocol):
    """What a stream needs from the server (HFServer): final choices, token texts and decoding."""

    def choice_json(self, index: int, row: Row, with_tools: bool) -> dict[str, Any]: ...

    def completion_choice_json(self, index: int, row: Row, top_logprobs: int | None) -> dict[str, Any]: ...

    def token_logprobs(self, row: Row, start: int, end: int) -> list[dict[str, Any]]: ...

    def legacy_logprobs(self, row: Row, start: int, end: int, offset: int) -> dict[str, Any]: ...

    def visible_text(self, row: Row) -> str: ...


@dataclass
class _Sent:
    tokens: int = 0
    text: str = ""
    started: bool = False
    finished: bool = False


def held_back(text: str, stops: list[str], hold: list[str]) -> str:
    """`text` without what later tokens may still change: a split character, a stop's or `hold`'s beginning."""
    text = text.removesuffix("\ufffd")
    cut = len(text)
    for marker in hold:
        found = text.find(marker)
        if found >= 0:
            cut = min(cut, found)
    for candidate in [*stops, *hold]:
        for k in range(min(len(candidate) - 1, len(text)), 0, -1):
            if text.endswith(candidate[:k]):
                cut = min(cut, len(text) - k)
                break
    return text[:cut]


class ChunkStream:
    """Turns rows that are being sampled into SSE events: `advance()` after new tokens (a finished row gets its
    last chunks), `usage()` once all rows finished."""

    def __init__(
        self,
        source: ChoiceSource,
        rows: list[Row],
        prompt: list[int],
        *,
        chat: bool,
        with_tools: bool = False,
        include_usage: bool = False,
        top_logprobs: int | None = None,
    ):
        self.source, self.rows, self.prompt, self.chat = source, rows, prompt, chat
        self.with_tools, self.include_usage, self.top_logprobs = with_tools, include_usage, top_logprobs
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.sent = [_Sent() for _ in rows]
        self.first = True

    def _event(self, model: str, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        body = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": model,
            "choices": choices,
            **extra,
        }
        if self.first:
            body["prompt_token_ids"], self.first = self.prompt, False
        if self.include_usage and "usage" not in body:
            body["usage"] = None
        return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"

    def advance(self, model: str) -> list[bytes]:
        """Events for the tokens sampled since the last call (finished rows end with their finish chunk)."""
        events = []
        for index, (row, sent) in enumerate(zip(self.rows, self.sent, strict=True)):
            if sent.finished:
                continue
            finish = row.finish_reason  # read before the tokens: a finished row has all of its tokens
            n = min(len(row.token_ids), len(row.logprobs), len(row.top))
            if finish is None and n == sent.tokens:
                continue
            if finish is None:
                text = held_back(self.source.visible_text(row), row.stop, [TOOL_CALL_START] * self.with_tools)
                choices = [self._delta(index, row, sent, n, text)]
            else:
                choices = self._final(index, row, sent)
            events += [self._event(model, [choice]) for choice in choices]  # one choice an event, as OpenAI
        return events

    def usage(self, model: str) -> list[bytes]:
        if not self.include_usage:
            return []
        completion = sum(len(r.token_ids) for r in self.rows)
        usage = {
            "prompt_tokens": len(self.prompt),
            "completion_tokens": completion,
            "total_tokens": len(self.prompt) + completion,  # the prompt once, as OpenAI and vLLM count it
        }
        return [self._event(model, [], usage=usage)]

    def _delta(self, index: int, row: Row, sent: _Sent, n: int, text: str) -> dict[str, Any]:
        new_text = text[len(sent.text) :] if text.startswith(sent.text) else ""
        choice = self._piece(index, row, sent, n, new_text)
        sent.tokens, sent.text = n, sent.text + new_text
        return choice

    def _piece(self, index: int, row: Row, sent: _Sent, n: int, text: str) -> dict[str, Any]:
        """One choice's part of a chunk: `text` and the tokens `sent.tokens:n` (without finish_reason)."""
        if self.chat:
            delta: dict[str, Any] = {"content": text}
            if not sent.started:
                delta = {"role": "assistant", **delta}
            logprobs = {"content": self.source.token_logprobs(row, sent.tokens, n)}
            choice = {"index": index, "delta": delta, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": text, "logprobs": None}
            if self.top_logprobs is not None:
                choice["logprobs"] = self.source.legacy_logprobs(row, sent.tokens, n, len(sent.text))
        sent.started = True
        return {**choice, "finish_reason": None, "token_ids": row.token_ids[sent.tokens : n]}

    def _final(self, index: int, row: Row, sent: _Sent) -> list[dict[str, Any]]:
        """The rest of a finished row: remaining text and tokens, tool calls, and the finish reason."""
        n = len(row.token_ids)
        if self.chat:
            final = self.source.choice_json(index, row, self.with_tools)
            content = final["message"]["content"] or ""
        else:
            final = self.source.completion_choice_json(index, row, self.top_logprobs)
            content = final["text"]
        rest = content[len(sent.text) :] if content.startswith(sent.text) else ""
        choices = [self._piece(index, row, sent, n, rest)]
        sent.tokens, sent.text, sent.finished = n, sent.text + rest, True
        calls = (final["message"].get("tool_calls") or []) if self.chat else []
        for k, call in enumerate(calls):
            head = {"index": k, "id": call["id"], "type": "function"}
            head["function"] = {"name": call["function"]["name"], "arguments": ""}
            arguments = {"index": k, "function": {"arguments": call["function"]["arguments"]}}
            choices += [
                {"index": index, "delta": {"tool_calls": [head]}, "logprobs": None, "finish_reason": None},
                {
                    "index": index,
                    "delta": {"tool_calls": [arguments]},
                    "logprobs": None,
                    "finish_reason": None,
                },
            ]
        choices[-1]["finish_reason"] = final["finish_reason"]
        return choices
