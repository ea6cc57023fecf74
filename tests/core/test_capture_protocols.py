"""OpenAI Responses-API and Anthropic Messages calls are captured as the chat turns they stand for.

The translation is checked on the shapes each API documents (tool calls, tool results, system prompts, streams);
then agents written with the OpenAI and Anthropic SDKs call a real vLLM server (which serves both routes) inside
capture scopes, and their trajectories tokenise for training.
"""

from __future__ import annotations

import json
import math

import anthropic
import openai
import pytest
from openai.types.chat.chat_completion import Choice
from transformers import AutoTokenizer

import artnb as art
from artnb import models
from artnb.core import capture_protocols as protocols
from artnb.core.tokenize import tokenize_trajectory

LOOKUP = {
    "type": "function",
    "name": "lookup",
    "description": "Find a note.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
}
CHAT_LOOKUP = {
    "type": "function",
    "function": {k: v for k, v in LOOKUP.items() if k != "type"},
}


def sse(events: list[dict]) -> bytes:
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events).encode()


def test_a_responses_request_becomes_the_chat_it_stands_for():
    request = {
        "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": "Use tools."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Find "}, {"type": "input_text", "text": "milk"}],
            },
            {"type": "reasoning", "summary": []},
            {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": '{"q": "milk"}'},
            {"type": "function_call", "call_id": "c2", "name": "lookup", "arguments": '{"q": "eggs"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "2 litres"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "none"}],
            },
        ],
        "tools": [LOOKUP, {"type": "web_search"}],
    }
    assert protocols.responses_messages(request) == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Find milk"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": '{"q": "milk"}'},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": '{"q": "eggs"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "2 litres"},
        {"role": "tool", "tool_call_id": "c2", "content": "none"},
    ]
    assert protocols.responses_tools(request) == [CHAT_LOOKUP], "built-in tools have no chat form"
    assert protocols.responses_messages({"input": "Hi"}) == [{"role": "user", "content": "Hi"}]


def test_a_response_becomes_a_choice_with_its_logprobs_calls_and_finish():
    logprobs = [{"token": "token_id:9", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": []}]
    message = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi"}]}
    response = {
        "status": "completed",
        "output": [
            {"type": "reasoning", "summary": []},
            {**message, "content": [{**message["content"][0], "logprobs": logprobs}]},
            {"type": "function_call", "call_id": "c9", "name": "lookup", "arguments": "{}"},
        ],
    }
    choice = Choice.model_validate(protocols.responses_choice(response))
    assert choice.message.content == "Hi" and choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].id == "c9" and choice.message.tool_calls[0].function.name == "lookup"
    assert [(t.token, t.logprob) for t in choice.logprobs.content] == [("token_id:9", -0.5)]
    text_tokens = [{**logprobs[0], "token": "Hi"}]
    with pytest.warns(UserWarning, match="--return-tokens-as-token-ids"):
        plain = protocols.responses_choice(
            {"output": [{**message, "content": [{**message["content"][0], "logprobs": text_tokens}]}]}
        )
    assert "logprobs" not in plain, "text tokens would be re-tokenised: the turn is kept without them"
    cut = {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}, "output": []}
    assert protocols.responses_choice(cut)["finish_reason"] == "length"
    stream = sse(
        [{"type": "response.created", "response": {}}, {"type": "response.completed", "response": response}]
    )
    assert protocols.response_from_events(stream) == response
    with pytest.raises(ValueError, match="no response.completed"):
        protocols.response_from_events(sse([{"type": "response.created", "response": {}}]))


def test_an_anthropic_request_and_message_become_chat():
    request = {
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": "Find milk"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Looking."},
                    {"type": "tool_use", "id": "t1", "name": "lookup", "input": {"q": "milk"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "text", "text": "2 litres"}],
                    },
                    {"type": "text", "text": "And eggs?"},
                ],
            },
        ],
        "tools": [{"name": "lookup", "description": "Find a note.", "input_schema": LOOKUP["parameters"]}],
    }
    assert protocols.anthropic_messages(request) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Find milk"},
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "milk"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "2 litres"},
        {"role": "user", "content": "And eggs?"},
    ]
    assert protocols.anthropic_tools(request) == [CHAT_LOOKUP]

    events = [
        {
            "type": "message_start",
            "message": {"id": "m", "role": "assistant", "content": [], "stop_reason": None},
        },
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "On "}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "it."}},
        {
            "type": "content_block_start",
            "index": 1,
            "content_block": {"type": "tool_use", "id": "t2", "name": "lookup", "input": {}},
        },
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": '{"q": '},
        },
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": '"eggs"}'},
        },
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 9}},
    ]
    with pytest.raises(ValueError, match="before message_stop"):
        protocols.message_from_events(sse(events))
    message = protocols.message_from_events(sse([*events, {"type": "message_stop"}]))
    choice = Choice.model_validate(protocols.anthropic_choice(message))
    assert choice.message.content == "On it." and choice.finish_reason == "tool_calls"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"q": "eggs"}
    assert (
        protocols.anthropic_choice({"content": [], "stop_reason": "max_tokens"})["finish_reason"] == "length"
    )


# Against a real vLLM server (it serves /v1/responses and /v1/messages) -------------------------------------


@pytest.fixture(scope="module")
async def vllm(tmp_path_factory):
    from artnb.backends.engines.vllm.client import VLLMEngine, vllm_import_error

    if (problem := vllm_import_error()) is not None:
        pytest.skip(f"needs vLLM: {problem}")
    engine = VLLMEngine(
        str(models.embedded_model_path()),
        "base",
        tmp_path_factory.mktemp("logs"),
        extra_args=["--max-model-len", "2048", "--return-tokens-as-token-ids"],
    )
    await engine.start(timeout=300)
    try:
        yield engine
    finally:
        await engine.stop()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(models.embedded_model_path()))


async def test_a_responses_api_agent_is_captured_with_its_sampled_tokens(vllm, tokenizer):
    client = openai.AsyncOpenAI(base_url=vllm.base_url, api_key=vllm.api_key, max_retries=0)
    ask = {"model": "base", "max_output_tokens": 6, "include": ["message.output_text.logprobs"]}

    async def agent() -> float:
        items: list = [{"role": "user", "content": "Name a fruit."}]
        first = await client.responses.create(input=items, instructions="Be brief.", **ask)
        items += [item.model_dump(exclude_none=True) for item in first.output]
        items.append({"role": "user", "content": "Another one?"})
        stream = await client.responses.create(input=items, instructions="Be brief.", stream=True, **ask)
        art.current_trajectory(required=True).metadata["second"] = "".join(
            [e.delta async for e in stream if e.type == "response.output_text.delta"]
        )
        return 1.0

    captured = await art.trajectory(agent())
    assert not captured.additional_histories, "the second call resent the first: one history"
    messages = captured.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[-1]["content"] == captured.metadata["second"]
    turns = [x for x in captured.messages_and_choices if isinstance(x, Choice)]
    assert len(turns) == 2 and all(1 <= len(t.logprobs.content) <= 6 for t in turns)
    (sequence,) = tokenize_trajectory(tokenizer, captured, 1.0)
    trained = [t for t, m in zip(sequence.token_ids, sequence.assistant_mask, strict=True) if m]
    sampled = [int(p.token.removeprefix("token_id:")) for t in turns for p in t.logprobs.content]
    assert trained == sampled, "the trainer trains the ids vLLM sampled"
    assert [x for x in sequence.logprobs if not math.isnan(x)] == [
        p.logprob for t in turns for p in t.logprobs.content
    ]


async def test_an_anthropic_sdk_agent_is_captured_and_trains_without_logprobs(vllm, tokenizer):
    client = anthropic.AsyncAnthropic(
        base_url=vllm.base_url.removesuffix("/v1"), api_key=vllm.api_key, max_retries=0
    )
    history = [{"role": "user", "content": "Name a fruit."}]

    async def agent() -> None:
        reply = await client.messages.create(model="base", max_tokens=6, system="Be brief.", messages=history)
        history.append(
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]}
        )
        history.append({"role": "user", "content": "Another one?"})
        async with client.messages.stream(
            model="base", max_tokens=6, system="Be brief.", messages=history
        ) as s:
            art.current_trajectory(required=True).metadata["second"] = await s.get_final_text()

    captured = await art.trajectory(agent())
    assert not captured.additional_histories
    assert [m["role"] for m in captured.messages()] == ["system", "user", "assistant", "user", "assistant"]
    assert captured.messages()[-1]["content"] == captured.metadata["second"]
    assert captured.trainable_turns() == 2
    with pytest.raises(ValueError, match="allow_training_without_logprobs=True"):
        tokenize_trajectory(tokenizer, captured, 1.0)
    (sequence,) = tokenize_trajectory(tokenizer, captured, 1.0, allow_training_without_logprobs=True)
    assert sum(sequence.assistant_mask) > 0
