"""Both engines speak the OpenAI API agents call, the same way: one suite, run against each by real clients.

Every case runs on the HF engine and on the vLLM engine, serving the embedded model: streamed and non-streamed
responses (validated by the OpenAI SDK's own types), forced tool calls, `/v1/completions`, the usual sampling
settings, and the clients users bring (the OpenAI SDK, LangChain's ChatOpenAI with bind_tools, litellm). The
engines also compute the same policy: equal first-token logprobs (fp32), base and LoRA. Training uses the logprobs
the engine returned as the old policy, so an engine whose numbers drift from the trainer's would bias every
importance ratio.
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
import torch
from openai.types.chat import ChatCompletion, ChatCompletionChunk

import artnb as art
from artnb import models
from artnb.backends.engines.hf.client import HFEngine
from artnb.backends.engines.vllm.client import VLLMEngine, vllm_import_error

if (problem := vllm_import_error()) is not None:
    pytest.skip(f"the vLLM engine needs vLLM: {problem}", allow_module_level=True)

pytestmark = pytest.mark.slow
PROMPTS = [
    [{"role": "user", "content": "Say hello."}],
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "system", "content": "You play tic-tac-toe."}, {"role": "user", "content": "Your move?"}],
]
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(models.embedded_model_path())


@pytest.fixture(scope="module")
def adapter(model_path, tmp_path_factory) -> str:
    """An adapter like PeftTrainer's (r=8, alpha 16, all linear layers) with random weights, so it matters."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    path = tmp_path_factory.mktemp("adapter") / "agent"
    get_peft_model(AutoModelForCausalLM.from_pretrained(model_path), config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
async def engines(model_path, adapter, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    hf = HFEngine(model_path, "base", logs, device="cpu")
    vllm = VLLMEngine(model_path, "base", logs, extra_args=["--max-model-len", "2048"])
    try:
        await asyncio.gather(hf.start(timeout=300), vllm.start(timeout=300))
        for engine in (hf, vllm):
            await engine.load_adapter("agent@1", adapter)
        yield {"hf": hf, "vllm": vllm}
    finally:
        await asyncio.gather(hf.stop(), vllm.stop())


@pytest.fixture(scope="module")
def clients(engines) -> dict[str, openai.AsyncOpenAI]:
    return {
        name: openai.AsyncOpenAI(base_url=e.base_url, api_key=e.api_key, max_retries=0)
        for name, e in engines.items()
    }


async def first_token(
    client: openai.AsyncOpenAI, model: str, messages: list
) -> tuple[int, float, list[float]]:
    """The greedy first token, its logprob, and the top-5 logprobs (sorted, so near-ties may swap tokens)."""
    completion = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=1, temperature=0, logprobs=True, top_logprobs=5
    )
    choice = completion.choices[0]
    first = choice.logprobs.content[0]
    return choice.model_extra["token_ids"][0], first.logprob, sorted(t.logprob for t in first.top_logprobs)


@pytest.mark.parametrize("model", ["base", "agent"])
async def test_first_token_logprobs_match(clients, model):
    for messages in PROMPTS:
        hf, vllm = await asyncio.gather(*(first_token(clients[e], model, messages) for e in ("hf", "vllm")))
        assert hf[0] == vllm[0], f"{model}: greedy token differs for {messages}"
        assert vllm[1] == pytest.approx(hf[1], abs=TOLERANCE)
        assert vllm[2] == pytest.approx(hf[2], abs=TOLERANCE)


async def test_the_adapter_changes_the_logprobs(clients):
    base, tuned = [await first_token(clients["vllm"], m, PROMPTS[0]) for m in ("base", "agent")]
    assert abs(base[1] - tuned[1]) > 100 * TOLERANCE or base[0] != tuned[0]


# The conformance cases: the same request on each engine ------------------------------------------------------
ENGINES = ["hf", "vllm"]
HELLO = [{"role": "user", "content": "Write one sentence about the sea."}]
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather in a city", "parameters": CITY},
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
        },
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


async def streamed(client: openai.AsyncOpenAI, **kwargs) -> tuple[list, ChatCompletion]:
    """The stream's chunks (each validated by the SDK's type) and the ChatCompletion they add up to."""
    chunks = [
        ChatCompletionChunk.model_validate(chunk.model_dump())
        async for chunk in await client.chat.completions.create(**kwargs, stream=True)
    ]
    return chunks, art.openai.accumulate_chunks(chunks)


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_completion_validates_against_the_sdk_types(clients, engine):
    raw = await clients[engine].chat.completions.with_raw_response.create(
        model="base", messages=HELLO, max_tokens=12, seed=1
    )
    completion = ChatCompletion.model_validate_json(raw.text)
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert (
        len(choice.model_extra["token_ids"])
        == len(choice.logprobs.content)
        == completion.usage.completion_tokens
    )


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_seeded_stream_adds_up_to_the_non_streamed_completion(clients, engine):
    request = dict(model="base", messages=HELLO, max_tokens=24, seed=7, temperature=1.0, logprobs=True)
    whole = (await clients[engine].chat.completions.create(**request)).choices[0]
    chunks, joined = await streamed(clients[engine], **request)
    choice = joined.choices[0]
    assert sum(bool(c.choices and c.choices[0].delta.content) for c in chunks) > 3  # sent as sampled
    assert choice.message.content == whole.message.content
    assert choice.finish_reason == whole.finish_reason
    assert choice.model_extra["token_ids"] == whole.model_extra["token_ids"]
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(
        [t.logprob for t in whole.logprobs.content], abs=1e-5
    )


@pytest.mark.parametrize("engine", ENGINES)
async def test_include_usage_ends_the_stream_with_the_usage(clients, engine):
    chunks, joined = await streamed(
        clients[engine], model="base", messages=HELLO, max_tokens=6, stream_options={"include_usage": True}
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])
    assert len(joined.choices[0].model_extra["token_ids"]) == 6


@pytest.mark.parametrize("engine", ENGINES)
async def test_usage_counts_the_prompt_once_for_several_choices(clients, engine):
    """n=3: usage as OpenAI reports it (a cost tracker or Langfuse reads total_tokens), streamed or not."""
    request = dict(model="base", messages=HELLO, max_tokens=5, n=3, extra_body={"min_tokens": 5})
    usage = (await clients[engine].chat.completions.create(**request)).usage
    chunks, _ = await streamed(clients[engine], **request, stream_options={"include_usage": True})
    for u in (usage, chunks[-1].usage):
        assert u.completion_tokens == 15
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def _check_calls(calls, allowed: set[str]) -> None:
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    assert calls, "a forced tool call must return tool_calls"
    for call in calls:
        assert call.id and call.type == "function" and call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}], ids=["required", "named"]
)
async def test_a_forced_tool_choice_returns_valid_calls(clients, engine, choice):
    allowed = {"get_weather", "get_time"} if choice == "required" else {"get_time"}
    request = dict(
        model="base",
        messages=ASK_WEATHER,
        tools=[WEATHER, TIME],
        tool_choice=choice,
        max_tokens=80,
        temperature=0,
    )
    whole = (await clients[engine].chat.completions.create(**request)).choices[0]
    _check_calls(whole.message.tool_calls, allowed)
    _, joined = await streamed(clients[engine], **request)
    calls = joined.choices[0].message.tool_calls
    _check_calls(calls, allowed)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls
    ]


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_json_schema_with_a_length_bound_yields_json(clients, engine):
    """xgrammar's own grammar for a length-bounded string admits raw control characters; both engines decode
    under the repaired one (json_grammar.py), which vLLM must accept as a grammar."""
    import jsonschema

    response_format = {"type": "json_schema", "json_schema": {"name": "place", "schema": CITY}}
    completion = await clients[engine].chat.completions.create(
        model="base", messages=ASK_WEATHER, n=4, seed=5, max_tokens=60, response_format=response_format
    )
    for choice in completion.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), CITY)


@pytest.mark.parametrize("engine", ENGINES)
async def test_tool_choice_none_leaves_a_written_call_as_text(clients, engine):
    written = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    request = dict(model="base", messages=ASK_WEATHER, tools=[WEATHER], max_tokens=60)
    message = (
        (
            await clients[engine].chat.completions.create(
                **request, tool_choice="none", extra_body={"structured_outputs": {"choice": [written]}}
            )
        )
        .choices[0]
        .message
    )
    assert not message.tool_calls and "get_weather" in message.content
    auto = (
        await clients[engine].chat.completions.create(
            **request, tool_choice="auto", extra_body={"structured_outputs": {"choice": [written]}}
        )
    ).choices[0]
    assert auto.finish_reason == "tool_calls" and auto.message.tool_calls[0].function.name == "get_weather"


@pytest.mark.parametrize("engine", ENGINES)
async def test_completions_endpoint_streamed_and_not(clients, engine):
    request = dict(model="base", prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=2)
    whole = (await clients[engine].completions.create(**request)).choices[0]
    assert whole.text and len(whole.logprobs.tokens) == len(whole.logprobs.token_logprobs) == 8
    assert all(len(top) == 2 for top in whole.logprobs.top_logprobs)
    text = "".join(
        [c.choices[0].text async for c in await clients[engine].completions.create(**request, stream=True)]
    )
    assert text == whole.text


@pytest.mark.parametrize("engine", ENGINES)
async def test_stop_max_tokens_and_greedy(clients, engine):
    client = clients[engine]
    greedy = (
        await client.chat.completions.create(model="base", messages=HELLO, max_tokens=20, temperature=0)
    ).choices[0]
    again = (
        await client.chat.completions.create(model="base", messages=HELLO, max_tokens=20, temperature=0)
    ).choices[0]
    assert greedy.message.content == again.message.content
    words = greedy.message.content.split()
    stop = " " + words[len(words) // 2]
    cut = (
        await client.chat.completions.create(
            model="base", messages=HELLO, max_tokens=20, temperature=0, stop=[stop]
        )
    ).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == greedy.message.content.split(stop)[0]
    short = (await client.chat.completions.create(model="base", messages=HELLO, max_tokens=5)).choices[0]
    assert short.finish_reason == "length" and len(short.model_extra["token_ids"]) == 5


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_default_temperature_is_what_requests_that_name_none_sample_at(engines, clients, engine):
    """`set_default_temperature` (ART's temperature annealing, core/temperature.py): at 0, requests that name no
    temperature decode greedily, as one that names 0 does; a request that names one keeps it; None restores the
    engine's own default. Out of range is refused by name."""
    client, served = clients[engine], engines[engine]
    ask = dict(model="base", messages=HELLO, max_tokens=16)
    greedy = (await client.chat.completions.create(**ask, temperature=0)).choices[0].message.content
    await served.set_default_temperature(0.0)
    try:
        for _ in range(2):
            assert (await client.chat.completions.create(**ask)).choices[0].message.content == greedy
        assert (await served.stats())["default_temperature"] == 0.0
        hot = [
            (await client.chat.completions.create(**ask, temperature=2.0, seed=seed))
            .choices[0]
            .message.content
            for seed in range(3)
        ]
        assert any(text != greedy for text in hot)  # named temperatures win over the default
        with pytest.raises(RuntimeError, match=r"/artnb/defaults failed \(4\d\d\).*temperature"):
            await served.set_default_temperature(3.0)
    finally:
        await served.set_default_temperature(None)
    assert (await served.stats())["default_temperature"] in (None, 1.0)  # vLLM's own / the HF engine's 1


def teacher(content: str | None, call: tuple[str, dict] | None = None) -> ChatCompletion:
    """A teacher model's completion (another model's, in ART's distillation example), as the SDK types it."""
    message: dict = {"role": "assistant", "content": content}
    if call is not None:
        function = {"name": call[0], "arguments": json.dumps(call[1])}
        message["tool_calls"] = [{"id": "call_1", "type": "function", "function": function}]
    return ChatCompletion.model_validate(
        {
            "id": "teacher",
            "object": "chat.completion",
            "created": 0,
            "model": "teacher",
            "choices": [{"index": 0, "finish_reason": "stop", "message": message}],
        }
    )


@pytest.mark.parametrize("engine", ENGINES)
async def test_guided_completion_params_make_the_student_answer_as_the_teacher(clients, engine):
    """`art.guided_completion.get_guided_completion_params`: the student, sampling freely (temperature 1), gives
    the teacher's tool call with the teacher's arguments, and the teacher's text word for word."""
    from artnb.guided_completion import get_guided_completion_params

    client = clients[engine]
    _, tool_choice, tools = get_guided_completion_params(
        teacher(None, ("get_weather", {"city": "Lyon"})), base_tools=[WEATHER, TIME]
    )
    call = (
        (
            await client.chat.completions.create(
                model="base", messages=ASK_WEATHER, tools=tools, tool_choice=tool_choice, max_tokens=80
            )
        )
        .choices[0]
        .message.tool_calls[0]
    )
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Lyon"})
    text = "It is sunny in Lyon."
    guided_choice, _, _ = get_guided_completion_params(teacher(text))
    reply = await client.chat.completions.create(
        model="base", messages=ASK_WEATHER, max_tokens=20, extra_body={"guided_choice": guided_choice}
    )
    assert reply.choices[0].message.content == text
    with pytest.raises(ValueError, match=r"the teacher called 'get_news', which base_tools does not hold"):
        get_guided_completion_params(teacher(None, ("get_news", {})), base_tools=[WEATHER])


async def test_penalties_mean_the_same_on_both_engines(clients):
    """Greedy decoding with presence and frequency penalties picks the same tokens on both engines."""
    request = dict(
        model="base", messages=[{"role": "user", "content": "Repeat: a a a a a a a a"}], max_tokens=16
    )
    plain, hf, vllm = await asyncio.gather(
        clients["hf"].chat.completions.create(**request, temperature=0),
        *(
            clients[e].chat.completions.create(
                **request, temperature=0, presence_penalty=1.0, frequency_penalty=1.5
            )
            for e in ENGINES
        ),
    )
    ids = [c.choices[0].model_extra["token_ids"] for c in (plain, hf, vllm)]
    assert ids[1] == ids[2], "the engines apply the penalties differently"
    assert ids[0] != ids[1], "the penalties changed nothing"


async def test_logit_bias_works_on_vllm_and_is_refused_by_the_hf_engine(clients, tokenizer):
    token = tokenizer.encode(" banana", add_special_tokens=False)[0]
    request = dict(model="base", messages=HELLO, max_tokens=1, temperature=0, logit_bias={str(token): 100})
    forced = await clients["vllm"].chat.completions.create(**request)
    assert forced.choices[0].model_extra["token_ids"] == [token]
    with pytest.raises(openai.BadRequestError, match="logit_bias is not supported by the HF engine"):
        await clients["hf"].chat.completions.create(**request)


async def test_the_hf_engine_refuses_what_it_would_ignore(clients):
    client = clients["hf"]
    with pytest.raises(openai.BadRequestError, match="echo is not supported"):
        await client.completions.create(model="base", prompt="Hi", max_tokens=2, echo=True)
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        await client.chat.completions.create(
            model="base", messages=HELLO, max_tokens=2, tool_choice="required"
        )
    with pytest.raises(openai.BadRequestError, match="not among the request's tools"):
        await client.chat.completions.create(
            model="base",
            messages=HELLO,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )


@pytest.mark.parametrize("engine", ENGINES)
async def test_langchain_chat_openai_with_bind_tools(engines, engine):
    from langchain_openai import ChatOpenAI

    e = engines[engine]
    chat = ChatOpenAI(base_url=e.base_url, api_key=e.api_key, model="base", temperature=0, max_tokens=60)
    reply = await chat.bind_tools([WEATHER], tool_choice="get_weather").ainvoke(ASK_WEATHER[0]["content"])
    (call,) = reply.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    whole = await chat.ainvoke("Say hello.")
    pieces = [piece async for piece in chat.astream("Say hello.")]
    assert "".join(p.content for p in pieces) == whole.content and len(pieces) > 2


@pytest.mark.parametrize("engine", ENGINES)
async def test_litellm_acompletion_against_the_engine(engines, clients, engine):
    import litellm

    e = engines[engine]
    request = dict(messages=HELLO, max_tokens=10, temperature=0)
    reference = (
        (await clients[engine].chat.completions.create(model="base", **request)).choices[0].message.content
    )
    options = dict(model="openai/base", api_base=e.base_url, api_key=e.api_key, **request)
    reply = await litellm.acompletion(**options)
    assert reply.choices[0].message.content == reference
    stream = await litellm.acompletion(**options, stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream]) == reference


@pytest.mark.parametrize("engine", ENGINES)
async def test_a_streamed_turn_trains_the_sampled_tokens(clients, tokenizer, engine):
    from artnb.core.tokenize import tokenize_trajectory

    _, joined = await streamed(clients[engine], model="base", messages=HELLO, max_tokens=12, seed=3)
    choice = joined.choices[0]
    [sequence] = tokenize_trajectory(
        tokenizer, art.Trajectory(messages_and_choices=[*HELLO, choice], reward=1.0), 1.0
    )
    trained = [t for t, m in zip(sequence.token_ids, sequence.assistant_mask, strict=True) if m]
    assert trained == choice.model_extra["token_ids"]
    assert [
        lp for lp, m in zip(sequence.logprobs, sequence.assistant_mask, strict=True) if m
    ] == pytest.approx([t.logprob for t in choice.logprobs.content])
