"""A stream's chunks add up to the ChatCompletion a trajectory stores: text, tool calls, logprobs, token ids."""

from __future__ import annotations

import asyncio

from openai.types.chat import ChatCompletionChunk

import artnb as art


def chunk(index=0, finish=None, **delta) -> ChatCompletionChunk:
    body = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    logprobs, token_ids = delta.pop("logprobs", None), delta.pop("token_ids", None)
    choice = {"index": index, "delta": delta, "finish_reason": finish}
    if logprobs is not None:
        choice["logprobs"] = {
            "content": [{"token": t, "logprob": lp, "bytes": None, "top_logprobs": []} for t, lp in logprobs]
        }
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return ChatCompletionChunk.model_validate({**body, "choices": [choice]})


CHUNKS = [
    chunk(role="assistant", content="Hel", logprobs=[("Hel", -0.5)], token_ids=[10]),
    chunk(index=1, role="assistant", content="", logprobs=[("<", -0.1)], token_ids=[7]),
    chunk(content="lo", logprobs=[("lo", -0.25)], token_ids=[11], finish="stop"),
    chunk(
        index=1,
        tool_calls=[
            {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}
        ],
    ),
    chunk(index=1, tool_calls=[{"index": 0, "function": {"arguments": '{"x": '}}]),
    chunk(index=1, tool_calls=[{"index": 0, "function": {"arguments": "1}"}}], finish="tool_calls"),
]


def test_chunks_add_up_to_each_choice():
    completion = art.openai.accumulate_chunks(CHUNKS)
    first, second = completion.choices
    assert first.message.content == "Hello" and first.finish_reason == "stop"
    assert [t.logprob for t in first.logprobs.content] == [-0.5, -0.25] and first.model_extra[
        "token_ids"
    ] == [10, 11]
    (call,) = second.message.tool_calls
    assert (call.id, call.function.name, call.function.arguments) == ("call_1", "f", '{"x": 1}')
    assert second.finish_reason == "tool_calls" and second.model_extra["token_ids"] == [7]


def test_consume_sees_every_chunk_and_returns_the_whole():
    seen = []

    async def stream():
        for c in CHUNKS:
            yield c

    completion = asyncio.run(
        art.openai.consume_chat_completion_stream(
            stream(), lambda c, so_far: seen.append(so_far.choices[0].message.content)
        )
    )
    assert completion.choices[0].message.content == "Hello" and seen[0] == "Hel" and len(seen) == len(CHUNKS)
