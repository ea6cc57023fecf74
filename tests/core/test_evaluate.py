"""evaluate(): the same scenarios played by several models on a real engine (tiny model), as one table."""

import math

import pytest

import artnb as art
from artnb.models import tiny
from artnb.plots import evaluation_figure
from artnb.tasks import tic_tac_toe


async def test_base_and_trained_models_play_the_same_games(tmp_path):
    model = art.TrainableModel(name="agent", project="p", base_model=tiny(hidden_size=64, num_layers=2))
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        base = model.as_base_model()
        assert base.get_inference_name() == model.base_model and not base.trainable

        async def rollout(m, scenario, **kwargs):
            if scenario == 13 and m is base:
                raise RuntimeError("scripted failure")
            return await tic_tac_toe.rollout(m, scenario, **kwargs)

        table = await art.evaluate(
            rollout, {"base": base, "trained": model}, [11, 12, 13], max_exceptions=1, temperature=0
        )
        with pytest.raises(art.TooManyExceptions, match="max_exceptions=0"):
            await art.evaluate(rollout, {"base": base}, [13], temperature=0)
    assert list(table["model"]) == ["base"] * 3 + ["trained"] * 3
    assert list(table["scenario"]) == [11, 12, 13] * 2
    failed = table[table["error"] != ""]
    assert list(failed["model"]) == ["base"] and "scripted failure" in failed["error"].iloc[0]
    played = table[table["error"] == ""]
    assert all(math.isfinite(r) for r in played["reward"]) and {"win", "legal_move_rate"} <= set(
        table.columns
    )
    summary = art.summarize_evaluation(table, ["reward", "legal_move_rate"])
    assert list(summary.index) == ["base", "trained"] and summary.loc["base", ("reward", "count")] == 2
    fig = evaluation_figure(table, ("reward", "win"))
    assert [t.name for t in fig.data] == ["reward", "win"] and list(fig.data[0].x) == ["base", "trained"]
    with pytest.raises(KeyError, match="no column \\['score'\\]"):
        art.summarize_evaluation(table, ["score"])


async def test_evaluate_rejects_empty_inputs():
    with pytest.raises(ValueError, match="at least one model"):
        await art.evaluate(tic_tac_toe.rollout, {}, [1])
    with pytest.raises(ValueError, match="at least one scenario"):
        await art.evaluate(tic_tac_toe.rollout, {"m": art.Model(name="m")}, [])
