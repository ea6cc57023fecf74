"""evaluate(): the same scenarios played by several models on a real engine (tiny model), as one table."""

import asyncio
import math

import pandas as pd
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
        sampled = await art.evaluate(rollout, {"trained": model}, [11, 12], temperature=1.0, samples=3)
        with pytest.raises(art.TooManyExceptions, match="max_exceptions=0"):
            await art.evaluate(rollout, {"base": base}, [13], temperature=0)
    assert list(table["model"]) == ["base"] * 3 + ["trained"] * 3
    assert list(table["scenario"]) == [11, 12, 13] * 2 and set(table["sample"]) == {0}
    assert list(sampled["scenario"]) == [11] * 3 + [12] * 3 and list(sampled["sample"]) == [0, 1, 2] * 2
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
    bars = fig.data[0]  # error bars reach the interval's ends
    low, high = summary.loc["base", ("reward", "low")], summary.loc["base", ("reward", "high")]
    assert bars.y[0] - bars.error_y.arrayminus[0] == pytest.approx(low)
    assert bars.y[0] + bars.error_y.array[0] == pytest.approx(high)
    with pytest.raises(KeyError, match="no column \\['score'\\]"):
        art.summarize_evaluation(table, ["score"])


async def test_evaluate_rejects_empty_inputs():
    with pytest.raises(ValueError, match="at least one model"):
        await art.evaluate(tic_tac_toe.rollout, {}, [1])
    with pytest.raises(ValueError, match="at least one scenario"):
        await art.evaluate(tic_tac_toe.rollout, {"m": art.Model(name="m")}, [])


def games(rows: list[tuple[str, int, float]], **columns) -> pd.DataFrame:
    """An evaluation table from (model, scenario, reward) rows."""
    return pd.DataFrame([{"model": m, "scenario": s, "reward": r, **columns} for m, s, r in rows])


def test_the_paired_difference_is_taken_scenario_by_scenario():
    # scenarios differ a lot, the models by exactly +0.1 on each: the paired interval is that one value,
    # although each model's own interval is wide
    base = [("base", s, float(s)) for s in range(6)]
    trained = [("trained", s, s + 0.1) for s in range(6)]
    table = games(base + trained)
    diff = art.paired_difference(table, "reward")
    assert (
        diff.mean == pytest.approx(0.1) and diff.low == pytest.approx(0.1) and diff.high == pytest.approx(0.1)
    )
    assert diff.excludes(0.0) and diff.n == 6
    summary = art.summarize_evaluation(table)
    assert summary.loc["base", ("reward", "high")] - summary.loc["base", ("reward", "low")] > 2


def test_repeated_samples_of_a_scenario_count_once_and_failed_games_are_left_out():
    # scenario 0: trained 1, 1 against base 0 -> +1; scenario 1: trained 0 (its second game failed) against
    # base 0, 1 (mean 0.5) -> -0.5. Resampling two paired values: -0.5, 0.25 or 1 -> [-0.5, 1]
    rows = [("trained", 0, 1.0), ("trained", 0, 1.0), ("base", 0, 0.0), ("base", 0, 0.0)]
    rows += [("trained", 1, 0.0), ("trained", 1, math.nan), ("base", 1, 0.0), ("base", 1, 1.0)]
    diff = art.paired_difference(games(rows), "reward", model="trained")
    assert (diff.mean, diff.low, diff.high, diff.n) == (0.25, -0.5, 1.0, 2)
    assert not diff.excludes(0.0)


def test_several_runs_make_the_interval_cover_the_runs():
    # run 0 improved every scenario by 1, run 1 by 0: over runs the difference may be anywhere in [0, 1]
    rows = []
    for run, gain in [(0, 1.0), (1, 0.0)]:
        rows += [{"model": "base", "scenario": s, "reward": 0.0, "run": run} for s in range(5)]
        rows += [{"model": "trained", "scenario": s, "reward": gain, "run": run} for s in range(5)]
    diff = art.paired_difference(pd.DataFrame(rows), "reward")
    assert (diff.low, diff.high, diff.runs, diff.n) == (0.0, 1.0, 2, 10)


def test_the_comparison_table_and_its_text():
    table = games([("base", s, 0.0) for s in range(6)] + [("trained (step 3)", s, 1.0) for s in range(6)])
    comparison = art.compare_evaluation(table, ["reward"])
    row = comparison.loc["reward"]
    assert (row["base"], row["trained (step 3)"], row["difference"], bool(row["shown"])) == (
        0.0,
        1.0,
        1.0,
        True,
    )
    text = art.format_comparison(comparison).splitlines()
    assert text[0].split() == ["metric", "base", "trained", "(step", "3)", "difference"]
    assert text[1].split()[0] == "reward" and text[1].endswith("+1.000 [+1.000, +1.000]  shown")
    # the same unanimous gain on 5 scenarios: a zero-width interval, yet too few scenarios to establish a sign
    few = art.compare_evaluation(table[table["scenario"] < 5], ["reward"])
    assert few.loc["reward", "low"] == 1.0 and not few.loc["reward", "shown"]
    assert art.format_comparison(few).endswith("not shown (too few scenarios: 5 < 6)")


def test_a_comparison_names_what_is_missing():
    table = games([("base", 0, 0.0), ("trained", 1, 1.0), ("other", 0, 1.0)])
    with pytest.raises(ValueError, match="no scenario was played by both 'trained' and 'base'"):
        art.paired_difference(table, "reward", model="trained")
    with pytest.raises(ValueError, match="name the one to compare with model="):
        art.paired_difference(table, "reward")
    with pytest.raises(ValueError, match="no games of baseline 'base model'"):
        art.paired_difference(table, "reward", baseline="base model")


async def test_max_concurrent_bounds_the_games_in_flight():
    in_flight, most = 0, 0

    async def rollout(model, scenario, **kwargs):
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return art.Trajectory(messages_and_choices=[], reward=float(scenario))

    models = {"a": art.Model(name="a"), "b": art.Model(name="b")}
    table = await art.evaluate(rollout, models, range(5), samples=2, max_concurrent=3)
    assert most == 3 and len(table) == 20 and list(table["sample"][:2]) == [0, 1]
    with pytest.raises(ValueError, match="max_concurrent=0"):
        await art.evaluate(rollout, models, [1], max_concurrent=0)


async def test_a_rollout_that_returns_its_reward_is_evaluated_like_one_that_returns_a_trajectory():
    async def rollout(model, scenario):
        return float(scenario)  # a captured rollout, as the README writes them

    table = await art.evaluate(rollout, {"a": art.Model(name="a")}, range(3))
    assert sorted(table["reward"]) == [0.0, 1.0, 2.0]
