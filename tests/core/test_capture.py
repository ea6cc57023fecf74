"""Captured trajectories: chat completions a rollout makes inside a scope become its trainable turns."""

from __future__ import annotations

import asyncio
import math

import openai
import pytest
from openai.types.chat.chat_completion import Choice
from served import served_model
from transformers import AutoTokenizer

import artnb as art
from artnb import models
from artnb.core.judge_requests import JudgeLimits, request_judge
from artnb.core.tokenize import tokenize_trajectory

SYSTEM = {"role": "system", "content": "You are a weather agent."}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def tiny() -> str:
    return models.tiny()


@pytest.fixture(scope="module")
async def policy(tiny, tmp_path_factory):
    async with served_model(tiny, tmp_path_factory.mktemp("logs"), max_batch_size=16) as model:
        yield model


@pytest.fixture(scope="module")
def client(policy) -> openai.AsyncOpenAI:
    return policy.openai_client()


async def agent(client: openai.AsyncOpenAI, question: str, keep: list | None = None) -> float:
    """A two-turn agent that keeps its own message list, as agents written for OpenAI do."""
    messages = [SYSTEM, {"role": "user", "content": question}]
    for turn in range(2):
        completion = await client.chat.completions.create(
            model="base", messages=messages, tools=[WEATHER], max_tokens=6, seed=turn
        )
        if keep is not None:
            keep.append(completion.choices[0])
        reply = completion.choices[0].message
        messages.append({"role": "assistant", "content": reply.content or ""})
        messages.append({"role": "user", "content": f"{question} (turn {turn + 2})"})
        await asyncio.sleep(0)  # let concurrent rollouts interleave between turns
    return 0.25


async def test_a_captured_rollout_trains_the_same_tokens_as_the_hand_built_one(client, tiny):
    kept: list[Choice] = []
    captured = await art.trajectory(agent(client, "Weather in Oslo?", kept))
    assert captured.reward == 0.25, "a number the rollout returns is its reward"
    assert captured.tools == [WEATHER]
    items = captured.messages_and_choices
    assert [type(x) is Choice for x in items] == [False, False, True, False, True]
    assert [x.message.content for x in items if isinstance(x, Choice)] == [c.message.content for c in kept]
    assert all(x.model_extra["token_ids"] for x in items if isinstance(x, Choice))

    by_hand = art.Trajectory(
        messages_and_choices=[
            SYSTEM,
            {"role": "user", "content": "Weather in Oslo?"},
            kept[0],
            {"role": "user", "content": "Weather in Oslo? (turn 2)"},
            kept[1],
        ],
        tools=[WEATHER],
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    (mine,) = tokenize_trajectory(tokenizer, captured, 1.0)
    (theirs,) = tokenize_trajectory(tokenizer, by_hand, 1.0)
    assert mine.token_ids == theirs.token_ids and mine.assistant_mask == theirs.assistant_mask
    assert [x for x in mine.logprobs if not math.isnan(x)] == [
        x for x in theirs.logprobs if not math.isnan(x)
    ]
    assert captured.metrics["duration"] > 0


async def test_concurrent_rollouts_never_mix_their_calls(client):
    questions = [f"Weather in city {i}?" for i in range(4)]
    with art.TrajectoryGroup() as opened:
        group = await art.trajectory_group(agent(client, q) for q in questions)
    assert [len(t.messages_and_choices) for t in group] == [5] * 4
    for question, trajectory in zip(questions, group, strict=True):
        users = [m["content"] for m in trajectory.messages() if m["role"] == "user"]
        assert users == [question, f"{question} (turn 2)"]
        assert not trajectory.additional_histories
    assert {id(t) for t in opened.trajectories} == {id(t) for t in group}, "the open group collects them"


async def test_streamed_and_sync_calls_are_captured_whole(client, policy):
    # 32 tokens, so that the stream comes in several chunks even on a busy machine (a chunk holds every token
    # sampled since the last one was sent)
    long = {"max_tokens": 32, "seed": 3, "extra_body": {"min_tokens": 32}}

    async def streamed() -> None:
        stream = await client.chat.completions.create(
            model="base", messages=[{"role": "user", "content": "Hi"}], stream=True, **long
        )
        chunks = [chunk async for chunk in stream]
        art.current_trajectory(required=True).metadata["chunks"] = len(chunks)

    captured = await art.trajectory(streamed())
    whole = await client.chat.completions.create(
        model="base", messages=[{"role": "user", "content": "Hi"}], **long
    )
    (choice,) = [x for x in captured.messages_and_choices if isinstance(x, Choice)]
    assert choice.message.content == whole.choices[0].message.content
    assert choice.model_extra["token_ids"] == whole.choices[0].model_extra["token_ids"]
    assert captured.metadata["chunks"] > 2

    sync = openai.OpenAI(base_url=policy.inference_base_url, api_key=policy.inference_api_key, max_retries=0)
    with art.Trajectory() as by_sync_client:
        sync.chat.completions.create(model="base", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert by_sync_client.trainable_turns() == 1


async def test_what_is_not_the_policys_turn_is_left_out_or_kept_apart(client, policy):
    hello = [{"role": "user", "content": "Hello"}]
    before = await client.chat.completions.create(model="base", messages=hello, max_tokens=2)
    assert before.choices, "a call outside any scope works as before"

    async def rollout() -> art.Trajectory:
        await client.chat.completions.create(model="base", messages=hello, max_tokens=3)
        with art.no_capture():
            await client.chat.completions.create(model="base", messages=hello, max_tokens=3)
        judge = {
            "model": "openai/base",
            "api_base": policy.inference_base_url,
            "api_key": policy.inference_api_key,
        }
        await request_judge(judge, hello, None, JudgeLimits(), attempts=1)
        summary = [{"role": "user", "content": "Summarise the chat so far."}]
        await client.chat.completions.create(model="base", messages=summary, max_tokens=3)
        art.current_trajectory(required=True).reward = 1.0
        return None

    captured = await art.trajectory(rollout())
    assert captured.reward == 1.0
    assert captured.trainable_turns() == 2, "no_capture and the judge's request are not recorded"
    (sub,) = captured.additional_histories
    assert sub.messages()[0]["content"] == "Summarise the chat so far."


async def test_art_spellings_and_clear_errors(client):
    async def classic() -> art.Trajectory:
        completion = await client.chat.completions.create(
            model="base", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        return art.Trajectory(messages_and_choices=[{"role": "user", "content": "Hi"}, completion.choices[0]])

    async def deep() -> None:
        art.yield_trajectory(await classic())

    assert (await art.trajectory(classic())).trainable_turns() == 1, "a returned Trajectory is the result"
    assert (await art.capture_yielded_trajectory(deep())).trainable_turns() == 1
    with pytest.warns(DeprecationWarning):
        captured = await art.capture_auto_trajectory(classic())
    assert captured.trainable_turns() == 1
    with pytest.raises(TypeError, match="without awaiting it"):
        await art.trajectory(0.5)
    with pytest.raises(RuntimeError, match="no trajectory is being captured"):
        art.current_trajectory(required=True)
    assert art.current_trajectory() is None
    with pytest.raises(RuntimeError, match="outside"):
        art.yield_trajectory(art.Trajectory())
    failed = await art.trajectory_group([classic(), _fails()], return_exceptions=True)
    assert len(failed) == 1 and failed.exceptions[0].type == "ValueError"
    with art.TrajectoryGroup() as opened:
        own = await art.trajectory(classic())
        with pytest.raises(ValueError, match="the tool broke"):
            await art.trajectory(_fails())
    assert len(opened.trajectories) == 1 and opened.trajectories[0] is own, "a failed rollout does not join"


async def _fails() -> None:
    raise ValueError("the tool broke")


async def test_arts_require_and_trajectory_keywords():
    """ART 0.5 spells `current_trajectory(require=...)` and `yield_trajectory(trajectory=...)`; artnb's
    `required=` still works, and the two disagreeing is an error rather than a silent pick."""
    with pytest.raises(RuntimeError, match="no trajectory is being captured"):
        art.current_trajectory(require=True)
    assert art.current_trajectory(require=False) is None
    with pytest.raises(RuntimeError, match="no trajectory group is open"):
        art.current_trajectory_group(require=True)
    with art.Trajectory() as opened:
        assert art.current_trajectory(require=True) is opened
        assert art.current_trajectory(required=True) is opened
    with art.TrajectoryGroup() as group:
        assert art.current_trajectory_group(require=True) is group
    with pytest.raises(TypeError, match="pass only require="):
        art.current_trajectory(require=True, required=False)

    async def deep() -> None:
        art.yield_trajectory(trajectory=art.Trajectory(reward=0.5))

    assert (await art.capture_yielded_trajectory(deep())).reward == 0.5
    with pytest.raises(TypeError, match="takes an art.Trajectory"):
        art.yield_trajectory(trajectory={"reward": 1})
