"""AutoRL: scenario generation (tiny model on a real HF engine; a scripted hosted model on a local HTTP server),
dedupe, the rollout and the base-vs-trained evaluation judged by RULER."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from openai.types.chat.chat_completion import Choice
from pydantic import ValidationError
from tiny_loop import tiny_model_served

from artnb import autorl
from artnb.autorl import Scenario, ScenarioGenerationError

TASK = "Write a one-sentence, friendly reply to a customer's complaint."


@pytest.fixture(scope="module")
async def served(tmp_path_factory):
    """A TrainableModel on the tiny random model, served by LocalBackend's HF engine (a few seconds)."""
    async with tiny_model_served(tmp_path_factory.mktemp("art"), "autorl") as model:
        yield model


def batch(*tasks: str) -> str:
    return json.dumps({"scenarios": [{"task": t, "difficulty": 2} for t in tasks]})


# dedupe ------------------------------------------------------------------------------------------------


def test_dedupe_drops_exact_normalised_and_near_duplicates():
    texts = [
        "Where is my order?",
        "where is my ORDER",  # same once normalised
        "My order: where is it?",  # same words, other order and punctuation
        "My parcel arrived broken and nobody answers the phone.",
        "My parcel arrived broken and nobody answers the phone!!",
        "The parcel arrived broken; no one answers the phone.",  # 6 of 11 words shared: kept at 0.8
    ]
    assert autorl.dedupe(texts) == [texts[0], texts[3], texts[5]]
    assert autorl.dedupe(texts, similarity=0.4) == [texts[0], texts[3]]
    assert autorl.normalize_text("Hello,  World!") == "hello world"
    assert autorl.token_set_similarity("a b c d", "a b c e") == pytest.approx(3 / 5)
    with pytest.raises(ValueError, match="similarity=0"):
        autorl.dedupe(texts, similarity=0)


def test_scenario_validates_and_strips_text():
    assert Scenario(task="  My order is late!  ", difficulty=3).task == "My order is late!"
    with pytest.raises(ValidationError, match="at least 8"):
        Scenario(task="late", difficulty=3)
    with pytest.raises(ValidationError, match="less than or equal to 5"):
        Scenario(task="My order is late!", difficulty=9)


# generation: the tiny model on a real engine, schema enforced while decoding -----------------------------


async def test_generate_with_served_model_gives_n_valid_distinct_scenarios(served):
    scenarios = await autorl.generate_scenarios(
        TASK, 7, model=served.as_base_model(), batch_size=3, max_task_chars=60, max_tokens=400, seed=1
    )
    assert len(scenarios) == 7
    assert all(isinstance(s, Scenario) and 8 <= len(s.task) <= 60 for s in scenarios)
    tasks = [s.task for s in scenarios]
    assert autorl.dedupe(tasks) == tasks
    assert scenarios.requests >= 3 and scenarios.proposed >= 7
    assert "7 scenarios from" in scenarios.summary()


async def test_generate_too_few_requests_is_a_clear_error(served):
    with pytest.raises(ScenarioGenerationError, match=r"asked for 6 scenarios, got \d after 1 requests"):
        await autorl.generate_scenarios(
            TASK, 6, model=served.as_base_model(), batch_size=2, max_requests=1, max_task_chars=40
        )


# generation: a scripted hosted model behind a local OpenAI-protocol server ------------------------------


async def test_generate_dedupes_and_asks_again_listing_what_it_has(scripted):
    hosted = scripted(
        [
            batch("Where is my order?", "where is my order", "My parcel arrived broken."),
            "not json at all",
            "```json\n" + batch("My parcel arrived broken!", "Why was I charged twice this month?") + "\n```",
            batch("The app logs me out every hour.", "hi"),
        ]
    )
    scenarios = await autorl.generate_scenarios(
        TASK, 4, model="openai/scripted", concurrency=1, extra_litellm_params=hosted.params, batch_size=3
    )
    assert [s.task for s in scenarios] == [
        "Where is my order?",
        "My parcel arrived broken.",
        "Why was I charged twice this month?",
        "The app logs me out every hour.",
    ]
    assert (scenarios.requests, scenarios.duplicates, scenarios.invalid) == (4, 2, 2)  # "hi" and the non-JSON
    last_prompt = hosted.requests[-1]["messages"][-1]["content"]
    assert "do not repeat" in last_prompt and "- Why was I charged twice this month?" in last_prompt
    schema = hosted.requests[0]["response_format"]["json_schema"]
    assert schema["strict"] is True and schema["schema"]["properties"]["scenarios"]["maxItems"] == 3
    assert [r["seed"] for r in hosted.requests] == [0, 1, 2, 3]


async def test_generate_gives_up_after_max_requests_saying_why(scripted):
    hosted = scripted([batch("Where is my order?", "Where is my order??")])
    kwargs = dict(model="openai/scripted", extra_litellm_params=hosted.params, max_requests=3, concurrency=1)
    with pytest.raises(ScenarioGenerationError, match=r"got 1 after 3 requests .* 5 duplicates"):
        await autorl.generate_scenarios(TASK, 3, **kwargs)
    with pytest.warns(UserWarning, match="asked for 3 scenarios, got 1"):
        fewer = await autorl.generate_scenarios(TASK, 3, allow_fewer=True, **kwargs)
    assert [s.task for s in fewer] == ["Where is my order?"]
    assert len(hosted.requests) == 6


async def test_generate_stops_at_once_when_the_provider_refuses(scripted):
    hosted = scripted([401])
    with pytest.raises(ScenarioGenerationError, match="refused the request .HTTP 401.*API key"):
        await autorl.generate_scenarios(TASK, 3, model="openai/scripted", extra_litellm_params=hosted.params)
    assert len(hosted.requests) == 1


async def test_generate_rejects_bad_arguments(monkeypatch):
    with pytest.raises(ValueError, match="task_description is empty"):
        await autorl.generate_scenarios("  ", 3, model="openai/x")
    with pytest.raises(ValueError, match="n=0"):
        await autorl.generate_scenarios(TASK, 0, model="openai/x")
    with pytest.raises(ValueError, match="max_task_chars=4"):
        await autorl.generate_scenarios(TASK, 2, model="openai/x", max_task_chars=4)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(ValueError, match="as_base_model"):
        await autorl.generate_scenarios(TASK, 2)


# rollout and evaluation ----------------------------------------------------------------------------------


async def test_rollout_keeps_the_reply_as_a_trainable_choice(served):
    scenario = Scenario(task="My order arrived two weeks late.", difficulty=2)
    traj = await autorl.rollout(served, scenario, system_prompt=autorl.system_prompt_for(TASK), max_tokens=8)
    system, user, reply = traj.messages_and_choices
    assert TASK in system["content"] and user == {"role": "user", "content": scenario.task}
    assert isinstance(reply, Choice) and reply.logprobs is not None
    assert traj.reward == 0.0 and traj.metadata["scenario"] == scenario.task and "duration" in traj.metrics


async def test_evaluate_judges_base_and_trained_answers_in_one_group(served):
    held_out = [
        Scenario(task="My order arrived two weeks late.", difficulty=2),
        Scenario(task="You charged my card twice for one sofa.", difficulty=3),
    ]
    result = await autorl.evaluate(
        served, held_out, served.as_base_model(), system_prompt=autorl.system_prompt_for(TASK), max_tokens=8
    )
    table = result.table
    assert list(table.columns) == ["scenario", "policy", "sample", "score", "explanation", "answer"]
    assert len(table) == 4 and set(table["policy"]) == {"base", "trained"}
    assert table["score"].between(0, 1).all()
    for group in result.groups:  # each group holds one scenario's answers from both policies
        assert {t.metadata["policy"] for t in group.trajectories} == {"base", "trained"}
        assert len({t.metadata["scenario"] for t in group.trajectories}) == 1
        assert all("ruler_score" in t.metrics for t in group.trajectories)
    assert list(result.means.index) == ["base", "trained"]
    assert isinstance(result.means, pd.Series) and "mean RULER score" in result._repr_html_()
    with pytest.raises(ValueError, match="at least one held-out scenario"):
        await autorl.evaluate(served, [], "openai/x", system_prompt="x")
