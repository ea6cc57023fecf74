"""A streamed chat completion, put back together: the `ChatCompletion` a trajectory stores from its chunks.

Why: agents that stream (`stream=True`) still need their turns trained on exactly the sampled tokens. Both
engines send, chunk by chunk, the text, the logprobs and the sampled `token_ids` (vLLM's `return_token_ids`,
set by artnb's middleware); joined here, the result is a `Choice` like a non-streamed one, `token_ids` and
all, so `Trajectory.messages_and_choices` takes it and the trainer trains the tokens that were sampled.
ART's spelling, `art.openai.consume_chat_completion_stream(stream, on_chunk)`, is in artnb/openai.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Callable, Iterable
from typing import Any

from openai.types.chat import ChatCompletion, ChatCompletionChunk


class StreamAccumulator:
    """Adds chunks one at a time; `completion()` is the ChatCompletion they make so far."""

    def __init__(self) -> None:
        self.head: dict[str, Any] = {}
        self.choices: dict[int, dict[str, Any]] = {}
        self.usage: Any = None
        self.prompt_token_ids: list[int] | None = None

    def add(self, chunk: ChatCompletionChunk) -> None:
        if not self.head:
            self.head = {"id": chunk.id, "created": chunk.created, "model": chunk.model}
        extra = chunk.model_extra or {}
        if self.prompt_token_ids is None and extra.get("prompt_token_ids") is not None:
            self.prompt_token_ids = list(extra["prompt_token_ids"])
        if chunk.usage is not None:
            self.usage = chunk.usage.model_dump()
        for part in chunk.choices:
            choice = self.choices.setdefault(
                part.index,
                {"content": None, "role": "assistant", "tool_calls": {}, "logprobs": None, "token_ids": []},
            )
            delta = part.delta
            if delta.content is not None:
                choice["content"] = (choice["content"] or "") + delta.content
            for call in delta.tool_calls or []:
                known = choice["tool_calls"].setdefault(
                    call.index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
                )
                known["id"] = call.id or known["id"]
                if call.function is not None:
                    known["function"]["name"] += call.function.name or ""
                    known["function"]["arguments"] += call.function.arguments or ""
            if part.logprobs is not None and part.logprobs.content is not None:
                choice["logprobs"] = (choice["logprobs"] or []) + [
                    t.model_dump() for t in part.logprobs.content
                ]
            choice["token_ids"] += (part.model_extra or {}).get("token_ids") or []
            if part.finish_reason is not None:
                choice["finish_reason"] = part.finish_reason

    def completion(self) -> ChatCompletion:
        choices = []
        for index, c in sorted(self.choices.items()):
            message: dict[str, Any] = {"role": "assistant", "content": c["content"]}
            if c["tool_calls"]:
                message["tool_calls"] = [c["tool_calls"][k] for k in sorted(c["tool_calls"])]
            choice: dict[str, Any] = {
                "index": index,
                "message": message,
                "finish_reason": c.get("finish_reason") or "stop",
                "logprobs": None if c["logprobs"] is None else {"content": c["logprobs"]},
            }
            if c["token_ids"]:
                choice["token_ids"] = c["token_ids"]
            choices.append(choice)
        body: dict[str, Any] = {
            **self.head,
            "object": "chat.completion",
            "choices": choices,
            "usage": self.usage,
        }
        if self.prompt_token_ids is not None:
            body["prompt_token_ids"] = self.prompt_token_ids
        return ChatCompletion.model_validate(body)


def accumulate_chunks(chunks: Iterable[ChatCompletionChunk]) -> ChatCompletion:
    """The ChatCompletion that `chunks` (a whole stream, e.g. a list) add up to."""
    accumulator = StreamAccumulator()
    for chunk in chunks:
        accumulator.add(chunk)
    return accumulator.completion()


async def consume_chat_completion_stream(
    stream: AsyncIterable[ChatCompletionChunk],
    on_chunk: Callable[[ChatCompletionChunk, ChatCompletion], Any] | None = None,
) -> ChatCompletion:
    """Read an async stream to its end and return its ChatCompletion; `on_chunk(chunk, so_far)` sees each chunk."""
    accumulator = StreamAccumulator()
    async for chunk in stream:
        accumulator.add(chunk)
        if on_chunk is not None:
            on_chunk(chunk, accumulator.completion())
    return accumulator.completion()
