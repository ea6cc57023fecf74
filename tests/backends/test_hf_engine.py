"""The HF engine as a user sees it: a real server process running the tiny model, called with the OpenAI client."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import artnb
from artnb import models
from artnb.backends.engines.hf.client import HFEngine
from artnb.backends.engines.hf.protocol import parse_tool_calls

HELLO = [{"role": "user", "content": "Say hello."}]
EOS = 2  # <|im_end|>


@pytest.fixture(scope="module")
def tiny() -> str:
    return models.tiny()


@pytest.fixture(scope="module")
async def engine(tiny, tmp_path_factory):
    engine = HFEngine(
        tiny, "base", tmp_path_factory.mktemp("logs"), device="cpu", max_batch_size=16, max_loras=3
    )
    await engine.start(timeout=120)
    yield engine
    await engine.stop()


@pytest.fixture(scope="module")
def client(engine) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=engine.base_url, api_key=engine.api_key, max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny):
    return AutoModelForCausalLM.from_pretrained(tiny).eval(), AutoTokenizer.from_pretrained(tiny)


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory) -> list[Path]:
    """Three LoRA adapters with random (non-zero) weights, so each changes the model's outputs differently."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("adapters")
    paths = []
    for seed in range(3):
        torch.manual_seed(seed)
        config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        get_peft_model(AutoModelForCausalLM.from_pretrained(tiny), config).save_pretrained(root / f"a{seed}")
        paths.append(root / f"a{seed}")
    return paths


async def chat(client: openai.AsyncOpenAI, **kwargs):
    return await client.chat.completions.create(
        **{"model": "base", "messages": HELLO, "max_tokens": 8, **kwargs}
    )


def gone(pid: int) -> bool:
    """True once `pid` has exited (a zombie nobody reaped counts as exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "\nState:\tZ" in status.read_text()


async def test_completion_shape(client, reference):
    completion = await chat(client, max_tokens=6, logprobs=True, top_logprobs=2)
    choice = completion.choices[0]
    assert completion.object == "chat.completion" and completion.model == "base"
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert len(choice.token_ids) == len(choice.logprobs.content) == completion.usage.completion_tokens
    assert all(lp.logprob <= 0 and len(lp.top_logprobs) == 2 for lp in choice.logprobs.content)
    _, tokenizer = reference
    assert tokenizer.decode(choice.token_ids, skip_special_tokens=True) == choice.message.content
    assert len(completion.prompt_token_ids) == completion.usage.prompt_tokens


async def test_logprobs_are_the_raw_model_logprobs(client, reference):
    """Whatever the temperature/top_p, reported logprobs are the model's log-softmax at temperature 1."""
    completion = await chat(client, max_tokens=10, temperature=0.6, top_p=0.8)
    model, _ = reference
    prompt, generated = completion.prompt_token_ids, completion.choices[0].token_ids
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(generated)[:, None])[:, 0]
    reported = torch.tensor([lp.logprob for lp in completion.choices[0].logprobs.content])
    torch.testing.assert_close(reported, expected, atol=1e-4, rtol=0)


async def test_slots_serve_by_default_and_a_dynamic_engine_answers_the_same(engine, client, tiny, tmp_path):
    """The engine decodes from its slot buffers (said in its stats), and `decoding="dynamic"` (every model's
    fallback) gives a seeded request the same tokens and logprobs."""
    stats = await engine.stats()
    assert stats["decoding"].startswith("slots") and not stats["cuda_graphs"]
    dynamic = HFEngine(tiny, "base", tmp_path, device="cpu", decoding="dynamic")
    await dynamic.start(timeout=120)
    try:
        assert (await dynamic.stats())["decoding"].startswith("dynamic, as asked")
        other = openai.AsyncOpenAI(base_url=dynamic.base_url, api_key=dynamic.api_key, max_retries=0)
        for seed in (1, 2):
            a, b = await chat(client, seed=seed, max_tokens=12), await chat(other, seed=seed, max_tokens=12)
            assert a.choices[0].token_ids == b.choices[0].token_ids
            lp = [[t.logprob for t in c.choices[0].logprobs.content] for c in (a, b)]
            assert max(abs(x - y) for x, y in zip(*lp, strict=True)) < 1e-4
    finally:
        await dynamic.stop()
    with pytest.raises(ValueError, match="decoding='paged': pass one of"):
        HFEngine(tiny, "base", tmp_path, decoding="paged")


async def test_n_choices(client):
    completion = await chat(client, n=3)
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in completion.choices}) > 1


async def test_seed_reproduces_sampling(client):
    first, second, other = await chat(client, seed=7), await chat(client, seed=7), await chat(client, seed=8)
    assert first.choices[0].token_ids == second.choices[0].token_ids
    assert first.choices[0].token_ids != other.choices[0].token_ids


async def test_temperature_zero_is_greedy(client):
    first, second = await chat(client, temperature=0, top_logprobs=1), await chat(client, temperature=0)
    assert first.choices[0].token_ids == second.choices[0].token_ids
    for lp in first.choices[0].logprobs.content:
        assert lp.logprob == pytest.approx(lp.top_logprobs[0].logprob)


async def test_stop_string_cuts_content_but_keeps_tokens(client):
    full = (await chat(client, seed=3, max_tokens=40)).choices[0]
    text = full.message.content
    start = next(
        i for i in range(5, len(text) - 3) if text[i : i + 3].isascii() and text[i : i + 3].isalpha()
    )
    stop = text[start : start + 3]
    cut = (await chat(client, seed=3, max_tokens=40, stop=["never-appears", stop])).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.message.content == text[: text.find(stop)]
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]
    assert len(cut.token_ids) < len(full.token_ids)


async def test_max_tokens_ends_with_length(client):
    completion = await chat(client, max_completion_tokens=3)
    assert completion.choices[0].finish_reason == "length" and len(completion.choices[0].token_ids) == 3


async def test_guided_choice_always_returns_a_choice(client):
    choices = ["yes", "no", "maybe later"]
    completion = await chat(client, n=16, max_tokens=20, extra_body={"guided_choice": choices})
    seen = set()
    for choice in completion.choices:
        assert choice.message.content in choices
        assert choice.finish_reason == "stop" and choice.token_ids[-1] == EOS
        seen.add(choice.message.content)
    assert len(seen) > 1, "a random model should not always pick the same choice"
    completion = await chat(client, n=4, extra_body={"structured_outputs": {"choice": ["A", "B"]}})
    assert {c.message.content for c in completion.choices} <= {"A", "B"}


NAMED = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
}
MOVE = {
    "type": "object",
    "properties": {
        "move": {"enum": ["A1", "B2", "C3"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["move", "n", "tags"],
}


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


async def test_json_schemas_constrain_each_row_of_a_shared_batch(engine, client):
    """Rows with different schemas and one unconstrained row, decoded together: each keeps its own constraint."""
    import jsonschema

    alone = await chat(client, seed=11, max_tokens=12)
    for schema in (NAMED, MOVE):  # compile first (cached after), so the four requests arrive together
        await chat(client, max_tokens=1, response_format=json_schema_format(schema))
    before = await engine.stats()
    named, move, by_vllm_key, free = await asyncio.gather(
        chat(client, n=3, max_tokens=60, response_format=json_schema_format(NAMED)),
        chat(client, n=2, max_tokens=60, response_format=json_schema_format(MOVE)),
        chat(client, max_tokens=60, extra_body={"structured_outputs": {"json": json.dumps(MOVE)}}),
        chat(client, seed=11, max_tokens=12),
    )
    after = await engine.stats()
    assert after["rows"] - before["rows"] == 7 and after["batches"] - before["batches"] <= 2
    for completion, schema in [(named, NAMED), (move, MOVE), (by_vllm_key, MOVE)]:
        for choice in completion.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), schema)
    assert len({c.message.content for c in named.choices}) > 1, "rows must sample independently"
    # The unconstrained row sampled exactly what it samples alone: no other row's grammar reached it.
    assert free.choices[0].token_ids == alone.choices[0].token_ids
    assert not free.choices[0].message.content.lstrip().startswith("{")


async def test_a_length_bounded_string_is_still_json(client):
    """xgrammar's own grammar for maxLength admits raw control characters; under it rows 0 and 14 of this seeded
    request held one (json_grammar.py)."""
    import jsonschema

    completion = await chat(client, n=16, seed=2, max_tokens=40, response_format=json_schema_format(NAMED))
    for choice in completion.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), NAMED)


async def test_json_object_and_guided_json(client):
    """Any JSON object: a random model may not close it within max_tokens, but it must start as one."""
    completion = await chat(client, n=2, max_tokens=30, response_format={"type": "json_object"})
    for choice in completion.choices:
        assert choice.message.content.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
    completion = await chat(client, max_tokens=60, extra_body={"guided_json": NAMED})
    assert set(json.loads(completion.choices[0].message.content)) == {"name", "ok"}


async def test_unsupported_or_ambiguous_constraints_are_clear_400s(client):
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "needs a schema"),
        ({"response_format": {"type": "yaml"}}, "'yaml' is not supported"),
        ({"response_format": json_schema_format({"type": "objekt"})}, "could not be compiled.*objekt"),
        ({"extra_body": {"structured_outputs": {"regex": "[a-z]+"}}}, "\\['regex'\\] not supported"),
        ({"extra_body": {"guided_grammar": "root ::= 'a'"}}, "guided_grammar are not supported"),
        (
            {"extra_body": {"structured_outputs": {"json": "{not json"}}},
            "structured_outputs.json is not valid",
        ),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"guided_choice": ["a"]}},
            "pass only one output constraint",
        ),
        ({"extra_body": {"guided_choice": []}}, "guided_choice is empty"),
    ]
    for kwargs, message in cases:
        with pytest.raises(openai.BadRequestError, match=message):
            await chat(client, **kwargs)
    assert (await chat(client)).choices[0].message.content is not None


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


async def test_tools_and_tool_call_parsing(client):
    assert (await chat(client, tools=[WEATHER])).choices[0].message.content is not None
    forced = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    choice = (
        await chat(client, tools=[WEATHER], max_tokens=60, extra_body={"guided_choice": [forced]})
    ).choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert call.function.arguments == '{"city": "Paris"}'


def test_parse_tool_calls_keeps_surrounding_text_and_skips_broken_blocks():
    calls, rest = parse_tool_calls(
        'Let me check. <tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>oops'
    )
    assert [c["function"]["name"] for c in calls] == ["f"] and rest == "Let me check. <tool_call>oops"


async def test_context_overflow_is_a_clear_400_and_server_keeps_serving(client):
    with pytest.raises(openai.BadRequestError, match="shorten the conversation or lower max_tokens") as error:
        await chat(client, max_tokens=2048)
    assert "context 2048" in str(error.value) and "at most" in str(error.value)
    long = [{"role": "user", "content": "word " * 2100}]  # no room left, max_tokens not given
    with pytest.raises(openai.BadRequestError, match="leaves no room to generate") as error:
        await chat(client, messages=long, max_tokens=None)
    assert "max_tokens" not in str(error.value)
    assert (await chat(client)).choices[0].message.content is not None


async def test_bad_requests(client):
    with pytest.raises(openai.NotFoundError, match="not served here; served: \\['base'"):
        await chat(client, model="nope")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        await chat(client, temperature=-1)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        await chat(client, model="nope", stream=True)  # refused before the stream begins, not inside it


async def test_wrong_api_key_is_401(engine):
    wrong = openai.AsyncOpenAI(base_url=engine.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        await chat(wrong)
    assert httpx.get(engine.base_url.removesuffix("/v1") + "/health").status_code == 200


async def test_adapters_load_resolve_latest_and_evict(engine, client, adapters):
    base = await chat(client, temperature=0)
    await engine.load_adapter("agent@1", str(adapters[0]))
    tuned = await chat(client, model="agent@1", temperature=0)
    assert tuned.model == "agent@1"
    assert [lp.logprob for lp in tuned.choices[0].logprobs.content] != [
        lp.logprob for lp in base.choices[0].logprobs.content
    ]
    await engine.load_adapter("agent@2", str(adapters[1]))
    latest, explicit = (
        await chat(client, model="agent", temperature=0),
        await chat(client, model="agent@2", temperature=0),
    )
    assert latest.model == "agent@2" and latest.choices[0].token_ids == explicit.choices[0].token_ids
    art_spelling = await chat(client, model="agent:step1", temperature=0)  # ART's serverless name for agent@1
    assert art_spelling.model == "agent@1" and art_spelling.choices[0].token_ids == tuned.choices[0].token_ids
    assert {m.id for m in (await client.models.list()).data} == {"base", "agent@1", "agent@2"}
    with pytest.raises(RuntimeError, match="adapter_config.json"):
        await engine.load_adapter("agent@9", "/nonexistent")
    await engine.load_adapter("agent@3", str(adapters[2]))
    await engine.load_adapter("agent@1", str(adapters[1]))  # max_loras=3: replaces itself, evicts nothing
    assert (await engine.stats())["adapters"] == ["agent@2", "agent@3", "agent@1"]
    await engine.load_adapter("other", str(adapters[0]))  # evicts the oldest-loaded, agent@2
    assert (await engine.stats())["adapters"] == ["agent@3", "agent@1", "other"]
    for name in ("agent@3", "agent@1", "other"):
        await engine.unload_adapter(name)
    assert (await chat(client, temperature=0)).choices[0].token_ids == base.choices[0].token_ids


async def test_hold_waits_for_in_flight_and_queues_new_requests(engine, client, adapters):
    await engine.load_adapter("policy@1", str(adapters[0]))
    # min_tokens: long enough that a loaded machine's slow stats polling still catches them running
    long = {"max_tokens": 400, "extra_body": {"min_tokens": 400}}
    # One request of 4 rows, not 4 requests: on a loaded machine these can arrive too far apart to share
    # the first batch, and a late one would rightly run on the adapter loaded during the hold.
    in_flight = asyncio.create_task(chat(client, model="policy", n=4, **long))
    while (await engine.stats())["running"] == 0:
        assert not in_flight.done(), "the batch ended before hold could catch it"
        await asyncio.sleep(0.01)
    await engine.hold()
    assert (await engine.stats())["running"] == 0
    queued = [asyncio.create_task(chat(client, model="policy", max_tokens=5)) for _ in range(3)]
    await engine.load_adapter("policy@2", str(adapters[1]))
    await asyncio.sleep(0.5)
    assert not any(task.done() for task in queued), "requests must wait while held"
    await engine.release()
    finished = await in_flight
    assert finished.model == "policy@1" and [c.finish_reason for c in finished.choices] == ["length"] * 4
    assert [c.model for c in await asyncio.gather(*queued)] == ["policy@2"] * 3
    await engine.unload_adapter("policy@1")
    await engine.unload_adapter("policy@2")


async def test_the_slot_buffers_stay_between_requests_and_a_hold_frees_them_for_the_trainer(engine, client):
    """The engine keeps its decoding buffers from one batch to the next (no allocation per request); a hold
    gives the memory back to the trainer beside it, and the next request gets the buffers at their largest."""
    await chat(client, n=4, max_tokens=4)
    kept = (await engine.stats())["slot_buffers"]
    assert kept is not None and kept["slots"] >= 4
    await chat(client, max_tokens=4)
    assert (await engine.stats())["slot_buffers"] == kept
    await engine.hold()
    try:
        assert (await engine.stats())["slot_buffers"] is None
    finally:
        await engine.release()
    await chat(client, max_tokens=4)
    assert (await engine.stats())["slot_buffers"] == kept


async def test_concurrent_requests_share_batches(engine, client):
    before = await engine.stats()
    await asyncio.gather(*[chat(client, max_tokens=16) for _ in range(8)])
    after = await engine.stats()
    assert after["requests"] - before["requests"] == 8 and after["rows"] - before["rows"] == 8
    assert after["batches"] - before["batches"] <= 2


async def test_a_request_joins_the_running_batch_and_is_answered_before_it_ends(engine, client):
    before = await engine.stats()
    long = asyncio.create_task(chat(client, max_tokens=400, extra_body={"min_tokens": 400}))
    while (await engine.stats())["running"] == 0:
        await asyncio.sleep(0.01)
    short = await chat(client, max_tokens=4, extra_body={"min_tokens": 4})
    assert short.usage.completion_tokens == 4
    assert not long.done(), "the short request waited for the long one"
    during = await engine.stats()
    assert during["joined_rows"] - before["joined_rows"] == 1 and during["batches"] == before["batches"]
    assert (await long).usage.completion_tokens == 400


async def test_a_client_leaving_a_stream_cancels_its_row(engine, client):
    before = await engine.stats()
    stream = await chat(client, max_tokens=1500, extra_body={"min_tokens": 1500}, stream=True)
    got = 0
    async for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].model_extra["token_ids"])
        if got == 3:
            break
    await stream.close()
    for _ in range(200):
        after = await engine.stats()
        if after["aborted_rows"] > before["aborted_rows"]:
            break
        await asyncio.sleep(0.05)
    assert after["aborted_rows"] == before["aborted_rows"] + 1 and not after["running"]


async def test_streamed_choices_interleave_and_each_ends_once(client):
    chunks = [c async for c in await chat(client, n=3, max_tokens=6, seed=5, stream=True)]
    finishes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1, 2]
    assert chunks[0].model_extra["prompt_token_ids"] and "prompt_token_ids" not in (
        chunks[1].model_extra or {}
    )
    joined = artnb.openai.accumulate_chunks(chunks)
    whole = await chat(client, n=3, max_tokens=6, seed=5)
    assert [c.message.content for c in joined.choices] == [c.message.content for c in whole.choices]


async def test_port_in_use_is_a_clear_error(engine, tiny, tmp_path):
    with pytest.raises(OSError, match=f"port {engine.port} .* in use.*port=None"):
        await HFEngine(tiny, "base", tmp_path, port=engine.port).start()


async def test_an_automatic_port_taken_while_the_server_loads_is_picked_again(tiny, tmp_path):
    """The race no check before launch can close: another program binds the engine's automatic port after the
    check and before the server does (it loads its model first). The engine starts on another port."""
    engine = HFEngine(tiny, "base", tmp_path, device="cpu")
    taken = engine.port
    squatter = socket.socket()

    async def squat_once_launched() -> None:
        while engine.pid is None:  # launched: the port was checked free, and the server is importing torch
            await asyncio.sleep(0.001)
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()

    try:
        await asyncio.gather(engine.start(timeout=120), squat_once_launched())
        assert engine.port != taken and engine.alive()
        models = httpx.get(f"{engine.base_url}/models", headers={"Authorization": f"Bearer {engine.api_key}"})
        assert [m["id"] for m in models.json()["data"]] == ["base"]
        first_log = tmp_path / f"hf_engine_{taken}.log"
        assert "address already in use" in first_log.read_text().lower()  # the first launch's own error
        open_files = {os.path.realpath(fd) for fd in Path("/proc/self/fd").iterdir() if fd.is_symlink()}
        assert str(first_log.resolve()) not in open_files  # the failed launch was stopped, its log closed
    finally:
        squatter.close()
        await engine.stop()


async def test_killed_engine_is_not_alive(tiny, tmp_path):
    engine = HFEngine(tiny, "base", tmp_path, device="cpu")
    await engine.start(timeout=120)
    os.kill(engine.pid, signal.SIGKILL)
    for _ in range(100):
        if not engine.alive():
            break
        await asyncio.sleep(0.05)
    assert not engine.alive() and engine.returncode == -signal.SIGKILL
    with pytest.raises(RuntimeError, match="not running"):
        await engine.hold()
    await engine.stop()


def test_server_exits_when_its_parent_dies(tiny, tmp_path):
    """A kernel killed with SIGKILL runs no atexit hooks: the server must notice on its own."""
    launcher = (
        "import sys; from artnb.backends.engines.hf.client import HFEngine; import asyncio\n"
        f"e = HFEngine({tiny!r}, 'base', {str(tmp_path)!r}, device='cpu')\n"
        "asyncio.run(e.start())\nprint(e.pid, flush=True)\nimport time; time.sleep(600)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(artnb.__file__).parent.parent)}
    parent = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, env=env, text=True)
    server_pid = int(parent.stdout.readline())
    assert not gone(server_pid)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while not gone(server_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(server_pid), f"server {server_pid} outlived its parent"


async def test_stop_leaves_no_process(engine):
    """Runs last in this file: it stops the shared engine (the fixture's own stop() is then a no-op)."""
    pid = engine.pid
    await engine.stop()
    assert not engine.alive() and gone(pid)


def test_the_engine_server_starts_without_the_openai_sdk():
    # An engine starts at every register and restart; the SDK's types were 1.5 s of its 11 s of imports.
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, artnb.backends.engines.hf.server; print('openai' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert run.stdout.strip() == "False"
