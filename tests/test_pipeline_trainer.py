"""PipelineTrainer and trajectory_group_batches on the tiny random model over the HF engine: with no lag allowed
it trains exactly what the synchronous loop trains; with lag allowed it overlaps, records the lag of every step
and never exceeds the bound; rollouts that fail are counted, a broken rollout_fn stops it with its error; a
kill -9 mid-run loses nothing committed (tests/reliability/test_kill_pipeline.py)."""

from __future__ import annotations

import asyncio

import pytest
from tiny_loop import scenario_group as rollout

import artnb as art
from artnb.models import tiny
from artnb.pipeline_trainer import PipelineTrainer, make_group_rollout_fn
from artnb.widgets import OffPolicyPlot

BASE = tiny(hidden_size=64, num_layers=2, seed=1)


def train_rows(model: art.TrainableModel):
    history = model.history()
    return history[history["split"] == "train"].sort_values("step").reset_index(drop=True)


async def test_without_lag_it_trains_what_the_synchronous_loop_trains(tmp_path):
    config = art.TrainConfig(learning_rate=1e-2)
    piped = art.TrainableModel(name="piped", project="p", base_model=BASE)
    synced = art.TrainableModel(name="synced", project="p", base_model=BASE)
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await piped.register(backend)
        trainer = PipelineTrainer(
            piped, backend, rollout, range(100), num_rollout_workers=2, min_batch_size=2, max_batch_size=2,
            max_steps_off_policy=0, max_steps=2, train_config=config, eval_fn=None,
        )  # fmt: skip
        summary = await trainer.train()
        await synced.register(backend)
        for step in range(2):
            groups = await asyncio.gather(*(rollout(synced, s, None) for s in (2 * step, 2 * step + 1)))
            await synced.train(groups, config=config)
    assert (summary.steps, summary.groups_trained, summary.stale_groups_discarded) == (2, 4, 0)
    a, b = train_rows(piped), train_rows(synced)
    assert list(a["step"]) == list(b["step"]) == [0, 1]
    assert list(a["train/loss"]) == pytest.approx(list(b["train/loss"]), rel=1e-4, abs=1e-6)
    assert list(a["train/reward"]) == pytest.approx(list(b["train/reward"]))
    assert list(a["train/steps_off_policy"]) == [0, 0] and "train/steps_off_policy" not in b
    for step in range(2):  # the same scenarios, in order, each once
        trained = piped.store.read_trajectories("train", step)
        assert sorted({t.metadata["scenario"] for g in trained for t in g}) == [2 * step, 2 * step + 1]
    assert piped.read_state()["_pipeline_trainer"] == {
        "step": 2,
        "scenario_offset": 4,
        "finished_after_offset": [],
    }


async def test_with_lag_it_overlaps_within_the_bound_and_records_it(tmp_path):
    model = art.TrainableModel(name="lagged", project="p", base_model=BASE)
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        plot = OffPolicyPlot(model)
        trainer = PipelineTrainer(
            model, backend, rollout, iter(range(100)), {"delay": 0.3}, num_rollout_workers=6, min_batch_size=2,
            max_batch_size=2, max_steps_off_policy=1, max_steps=4, learning_rate=1e-2, plots=[plot],
        )  # fmt: skip
        summary = await trainer.train()
    rows = train_rows(model)
    assert summary.steps == 4 and list(rows["step"]) == [0, 1, 2, 3]
    assert rows["train/steps_off_policy_max"].max() <= 1  # the bound
    assert rows["train/steps_off_policy"].max() > 0  # rollouts ran while steps trained
    for column in ("train/ratio_std", "train/discarded_stale_groups", "throughput/step_trainer_idle_s"):
        assert rows[column].notna().all(), column
    assert plot.metrics["train/steps_off_policy_max"] == list(
        rows["train/steps_off_policy_max"]
    )  # refreshed live
    assert len(plot.metrics["train/ratio_std"]) == 4
    trained = [t for s in range(4) for g in model.store.read_trajectories("train", s) for t in g]
    assert len({t.metadata["scenario"] for t in trained}) == 8  # no scenario trained twice


async def test_failed_rollouts_are_skipped_and_a_broken_rollout_fn_stops_it(tmp_path):
    async def sometimes(model, scenario, config):
        if scenario % 3 == 1:
            raise ConnectionError("the environment went away")
        return await rollout(model, scenario, config)

    async def single(model, scenario, config):
        return (await rollout(model, scenario, config)).trajectories[0]

    model = art.TrainableModel(name="failing", project="p", base_model=BASE)
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        with pytest.warns(UserWarning, match="a rollout failed .*ConnectionError"):
            summary = await PipelineTrainer(
                model, backend, sometimes, range(6), min_batch_size=2, max_batch_size=2, max_steps_off_policy=0,
                learning_rate=1e-2, num_rollout_workers=2,
            ).train()  # fmt: skip
        assert (summary.failed_rollouts, summary.groups_trained) == (2, 4)
        with pytest.raises(RuntimeError, match="must return an art.TrajectoryGroup .*make_group_rollout_fn"):
            await PipelineTrainer(model, backend, single, range(100, 110), min_batch_size=2).train()
        grouped = make_group_rollout_fn(single, n=3)
        assert len(await grouped(model, 7, None)) == 3
    with pytest.raises(ValueError, match="max_batch_size"):
        PipelineTrainer(model, None, rollout, [], min_batch_size=4, max_batch_size=2)


async def test_trajectory_group_batches_hands_over_batches_as_groups_finish():
    started: list[int] = []

    async def one(i: int) -> art.Trajectory:
        started.append(i)
        await asyncio.sleep(0.05 * (i % 3))
        if i == 5:
            raise ValueError("rollout 5 failed")
        return art.Trajectory(messages_and_choices=[{"role": "user", "content": str(i)}], reward=i)

    def groups():
        for i in range(10):
            yield art.TrajectoryGroup([one(i)])

    batches = []
    async for batch in art.trajectory_group_batches(
        groups(), batch_size=3, max_concurrent_batches=1, skip_batches=1
    ):
        # taken + waiting to fill a batch (< 3) + running (<= batch_size * max_concurrent_batches = 3)
        assert len(started) <= 3 * len(batches) + 2 + 3
        batches.append(batch)
    assert [len(b) for b in batches] == [3, 3, 1]  # 7 groups after skipping 3; the last batch is smaller
    assert sorted(t.reward for b in batches for g in b for t in g) == [3, 4, 6, 7, 8, 9]
    assert sum(len(g.exceptions) for b in batches for g in b) == 1  # rollout 5's failure, kept in its group
    assert min(started) == 3  # skipped groups never started

    async def broken():
        raise OSError("no scenario")

    with pytest.raises(art.TooManyExceptions):
        async for _ in art.trajectory_group_batches(
            [broken(), broken()], batch_size=2, max_batch_exceptions=1
        ):
            pass
