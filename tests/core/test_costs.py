"""Costs of judges and hosted models in the history (`costs/{source}/...`), against a real local OpenAI-compatible
server (fake_openai.py; it reports 10 prompt and 10 completion tokens per request): RULER in a training loop,
a hosted comparison model, `art.metrics.track_api_cost`, and ART's metrics_builder/activate_metrics_context."""

from __future__ import annotations

import pytest
from fake_openai import FakeJudge
from tiny_loop import gather

import artnb as art
from artnb.models import tiny

BASE = tiny(hidden_size=64, num_layers=2, seed=1)


@pytest.fixture(scope="module")
def judge():
    with FakeJudge() as server:
        yield server


async def test_ruler_costs_are_recorded_with_the_step_they_were_spent_in(judge, tmp_path):
    params = {"api_base": judge.url, "api_key": "k"}
    model = art.TrainableModel(name="agent", project="costs", base_model=BASE)
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        for step in range(2):
            groups = await gather(model, step)
            scored = [await art.ruler_score_group(g, "openai/judge", params, cache=False) for g in groups]
            if step == 1:  # a judge whose price litellm knows: the spend in USD too
                scored.append(
                    await art.ruler_score_group(groups[0], "openai/gpt-4o-mini", params, cache=False)
                )
            await model.train(scored, config=art.TrainConfig(learning_rate=1e-2))
    history = model.history().set_index("step")
    assert list(history["costs/judge/ruler/requests"]) == [2, 3]
    assert list(history["costs/judge/ruler/prompt_tokens"]) == [20, 30]
    assert list(history["costs/judge/ruler/completion_tokens"]) == [20, 30]
    assert history["costs/judge/ruler/usd"].isna()[0]  # "openai/judge" has no price: absent, not $0
    assert 0 < history["costs/judge/ruler/usd"][1] < 0.001
    assert len(history) == 2  # merged into each step's record, not rows of their own


async def test_a_hosted_models_calls_are_its_own_costs(judge, tmp_path):
    hosted = art.Model(name="gpt", project="costs", inference_base_url=judge.url, inference_api_key="k")
    hosted.inference_model_name = "gpt-4o-mini"
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await hosted.register(backend)
        for _ in range(3):
            await hosted.openai_client().chat.completions.create(
                model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}]
            )
        row = await hosted.log(split="val", metrics={"reward": 0.5})
        assert row["costs/model/gpt/requests"] == 3 and row["costs/model/gpt/prompt_tokens"] == 30
        assert row["costs/model/gpt/usd"] > 0
        assert "costs/model/gpt/requests" not in await hosted.log(split="val", metrics={"reward": 0.4})


async def test_track_api_cost_and_the_metrics_context(tmp_path):
    @art.metrics.track_api_cost(source="tools/search", provider="openai", model_name="gpt-4o-mini")
    async def search() -> dict:
        return {"usage": {"prompt_tokens": 1000, "completion_tokens": 100}}

    first = art.Model(name="first", project="costs", base_path=str(tmp_path))
    second = art.Model(name="second", project="costs", base_path=str(tmp_path))
    with second.activate_metrics_context(second.metrics_builder()):
        await search()
    await search()  # outside any context: the next row of any model takes it
    row = await first.log(split="val", metrics={"reward": 1.0})
    assert row["costs/tools/search/requests"] == 1 and row["costs/tools/search/prompt_tokens"] == 1000
    row = await second.log(split="val", metrics={"reward": 1.0})
    assert row["costs/tools/search/requests"] == 1 and row["costs/tools/search/usd"] > 0
    with pytest.raises(ValueError, match="costs/<source>"):
        art.metrics.track_api_cost(source="no spaces allowed")


async def test_the_metrics_builder_fills_the_next_row_once(tmp_path):
    model = art.Model(name="builder", project="costs", base_path=str(tmp_path))
    builder = model.metrics_builder("train")
    with builder.measure("time/step_actor_s"):
        pass
    with pytest.raises(KeyError), builder.measure("time/step_tool_s"):  # measured even when the block raises
        raise KeyError("a rollout failed")
    builder.add_data(step_num_scenarios=3, step_actor_tokens=120, scenario_ids=["a", "b"])
    builder.add_data(step_num_scenarios=2, scenario_ids=["b", "c"])
    builder.add_idle_times(step_trainer_idle_s=1.5, step_actor_idle_s=0.25)
    builder.add_cost("tools/weather", usd=0.002)
    row = await model.log(split="train", metrics={"reward": 1.0})
    assert row["time/step_actor_s"] >= 0 and row["time/step_tool_s"] >= 0
    assert row["data/step_num_scenarios"] == 5 and row["data/step_actor_tokens"] == 120
    assert row["data/num_unique_scenarios"] == 3
    assert row["throughput/step_trainer_idle_s"] == 1.5 and row["throughput/step_actor_idle_s"] == 0.25
    assert row["costs/tools/weather/usd"] == pytest.approx(0.002)
    builder.add_data(scenario_ids=["a", "d"])  # unique ids count across rows
    row = await model.log(split="train", metrics={"reward": 1.0})
    assert row["data/num_unique_scenarios"] == 4 and "time/step_actor_s" not in row
    for bad in ("no_section", "time/cum/step_actor_s", "costs/x/usd"):
        with pytest.raises(ValueError, match="metric"):
            builder.add_metric(bad, 1.0)


async def test_registered_pricing_wins_over_litellms_and_prices_unknown_models(tmp_path):
    @art.metrics.track_api_cost(source="tools/mine", model_name="my-finetune")
    def mine() -> dict:
        return {
            "usage": {
                "prompt_tokens": 1000,
                "completion_tokens": 500,
                "prompt_tokens_details": {"cached_tokens": 400},
            }
        }

    model = art.Model(name="priced", project="costs", base_path=str(tmp_path))
    model.activate_metrics_context("train")  # ART's style: no `with`, active for the rest of this task
    mine()
    assert "costs/tools/mine/usd" not in await model.log(
        split="val", metrics={"reward": 1.0}
    )  # unknown price
    model.metrics_builder().register_model_pricing(
        "my-finetune", prompt_per_million=2.0, completion_per_million=8.0, cached_prompt_per_million=0.5
    )
    mine()
    row = await model.log(split="val", metrics={"reward": 1.0})
    assert row["costs/tools/mine/usd"] == pytest.approx((600 * 2.0 + 400 * 0.5 + 500 * 8.0) / 1e6)
    with pytest.raises(ValueError, match="per million"):
        model.metrics_builder().register_model_pricing("x", prompt_per_million=-1, completion_per_million=1)


async def test_a_cost_calculator_prices_the_trained_models_own_completions(tmp_path):
    """ART's set_cost_calculator: inside a named metrics context (ART's `cost_context=` keyword), each completion
    of the trainable model is priced by the calculator from its token counts; outside one, nothing is."""
    seen = []

    def calculator(prompt_tokens, completion_tokens, cost_context):
        seen.append((prompt_tokens, completion_tokens, cost_context))
        return {f"costs/{cost_context}/prefill": prompt_tokens * 1e-3, "not_a_cost": 9.0}

    model = art.TrainableModel(name="agent", project="costs", base_model=BASE)
    assert model.cost_calculator(10, 2, "train") == {}, "no calculator: nothing is priced"
    with pytest.raises(TypeError, match="set_cost_calculator takes a function"):
        model.set_cost_calculator("0.1 per token")  # type: ignore[arg-type]
    model.set_cost_calculator(calculator)
    assert model.cost_calculator is calculator
    ask = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        client = model.openai_client()
        await client.chat.completions.create(model=model.get_inference_name(), **ask)  # no context: unpriced
        assert seen == []
        with model.activate_metrics_context(cost_context="train"):
            reply = await client.chat.completions.create(model=model.get_inference_name(), n=2, **ask)
        prompt = reply.usage.prompt_tokens
        assert seen == [(prompt * 2, reply.usage.completion_tokens, "train")], (
            "prompt counted once per choice"
        )
        row = await model.log(split="val", metrics={"reward": 1.0})
        assert row["costs/train/prefill/usd"] == pytest.approx(prompt * 2e-3)
        assert not any("not_a_cost" in k for k in row)
        model.set_cost_calculator(None)
        with model.activate_metrics_context(cost_context="train"):
            await client.chat.completions.create(model=model.get_inference_name(), **ask)
        assert len(seen) == 1
