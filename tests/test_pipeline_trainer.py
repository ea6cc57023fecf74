"""PipelineTrainer and trajectory_group_batches on the tiny random model over the HF engine: with no lag allowed
it trains exactly what the synchronous loop trains; with lag allowed it overlaps, records the lag of every step
and never exceeds the bound; rollouts that fail are counted, a broken rollout_fn stops it with its error; a
kill -9 mid-run loses nothing committed (tests/reliability/test_kill_pipeline.py)."""

from __future__ import annotations

import asyncio
import warnings

import pytest
from tiny_loop import scenario_group as rollout

import artnb as art
from artnb.core import ignored
from artnb.models import tiny
from artnb.pipeline_trainer import (
    CheckpointInfo,
    CheckpointRetentionContext,
    PipelineTrainer,
    _Finished,
    _Run,
    keep_recent_and_top,
    make_group_rollout_fn,
)
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


async def test_art_0_5_23_keywords_run_it_and_retention_deletes_what_the_strategy_drops(tmp_path):
    """`pipeline=PipelineRuntimeConfig(...)`, `limit_mean_steps_off_policy` as the only bound, `kl_penalty_coef`,
    and a retention strategy that keeps the newest checkpoint it is offered: old checkpoints go as it trains."""
    model = art.TrainableModel(name="retained", project="p", base_model=BASE)
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        trainer = PipelineTrainer(
            model, backend, rollout, range(100),
            pipeline=art.PipelineRuntimeConfig(num_rollout_workers=2, min_batch_size=2, max_batch_size=2),
            max_steps_off_policy=None, limit_mean_steps_off_policy=0.0, max_steps=4, learning_rate=1e-2,
            kl_penalty_coef=0.01, optimizer_save_interval=5,
            checkpoint_retention_strategy=keep_recent_and_top(recent=1, top=0),
        )  # fmt: skip
        assert trainer.train_config.kl_penalty_coef == 0.01 and trainer.max_batch_size == 2
        summary = await trainer.train()
    rows = train_rows(model)
    assert summary.steps == 4 and rows["train/steps_off_policy_max"].max() == 0  # the mean limit bounds it
    steps = model.store.steps()
    assert steps[-1] == 4 and 0 not in steps and 1 not in steps and len(steps) <= 3


async def test_limit_mean_steps_off_policy_drops_a_group_by_the_mean_lag_of_its_trajectories():
    def finished(*versions: int) -> _Finished:
        group = art.TrajectoryGroup(
            [art.Trajectory(reward=float(i), initial_policy_version=v) for i, v in enumerate(versions)]
        )
        return _Finished(index=0, group=group, version=min(versions))

    trainer = PipelineTrainer(
        None, None, rollout, [], max_steps_off_policy=None, limit_mean_steps_off_policy=0.5
    )  # type: ignore[arg-type]
    run = _Run(trainer, asyncio.get_running_loop(), step=3, offset=0, done=set())
    assert not run._too_stale(finished(3, 2))  # lags 0 and 1: mean 0.5
    assert run._too_stale(finished(2, 2))  # mean 1
    assert run._start_bound() == 1  # rollouts start only while they can stay within the mean
    both = PipelineTrainer(None, None, rollout, [], max_steps_off_policy=0, limit_mean_steps_off_policy=5)  # type: ignore[arg-type]
    assert _Run(both, asyncio.get_running_loop(), step=3, offset=0, done=set())._too_stale(finished(3, 2))
    run.bar.close()


def test_pipeline_settings_come_once_from_the_config_or_the_older_keywords(monkeypatch):
    monkeypatch.setattr(ignored, "_reported", set())
    old = PipelineTrainer(None, None, rollout, [], num_rollout_workers=3, min_batch_size=2, queue_maxsize=5)  # type: ignore[arg-type]
    new = PipelineTrainer(  # type: ignore[arg-type]
        None,
        None,
        rollout,
        [],
        pipeline=art.PipelineRuntimeConfig(num_rollout_workers=3, min_batch_size=2, queue_maxsize=5),
    )
    for trainer in (old, new):
        assert (trainer.num_rollout_workers, trainer.min_batch_size, trainer.max_batch_size) == (3, 2, 20)
        assert trainer.queue_maxsize == 5
    with pytest.raises(ValueError, match=r"min_batch_size given both as keyword\(s\) and through pipeline="):
        PipelineTrainer(None, None, rollout, [], pipeline=art.PipelineRuntimeConfig(), min_batch_size=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_batch_size .* must be >= min_batch_size"):
        art.PipelineRuntimeConfig(min_batch_size=4, max_batch_size=2)
    with pytest.raises(ValueError, match="extra"):
        art.PipelineRuntimeConfig(min_batch=4)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="limit_mean_steps_off_policy"):
        PipelineTrainer(None, None, rollout, [], limit_mean_steps_off_policy=-1)  # type: ignore[arg-type]


def test_arts_pipeline_knobs_with_no_effect_here_are_reported_once_each(monkeypatch):
    monkeypatch.setattr(ignored, "_reported", set())
    with pytest.warns(UserWarning) as caught:
        PipelineTrainer(  # type: ignore[arg-type]
            None, object(), rollout, [],
            autotune=art.PipelineAutotuneConfig(mode="online", window_steps=3),
            score_reference_groups_per_step=4.0, kl_penalty_step_lag=2, rollout_executor=object(),
            grad_accumulation_sequences=4, checkpoint_retention_strategy=keep_recent_and_top(),
        )  # fmt: skip
    said = " ".join(str(w.message) for w in caught)
    for name in ("autotune", "score_reference_*", "kl_penalty_step_lag", "rollout_executor",
                 "grad_accumulation_sequences", "checkpoint_retention_strategy"):  # fmt: skip
        assert f"{name}" in said, name
    assert "object cannot delete chosen checkpoints" in said  # a backend without retention: said so
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the defaults, and autotune off, ask for nothing
        PipelineTrainer(
            None, None, rollout, [], autotune=art.PipelineAutotuneConfig(), optimizer_save_interval=5
        )  # type: ignore[arg-type]


def test_keep_recent_and_top_keeps_the_newest_and_the_best_offered():
    infos = [
        CheckpointInfo(step=s, path=f"/c/{s}", created_at="2026-01-01T00:00:00Z", metrics=m)
        for s, m in [(1, {"val/reward": 0.9}), (2, {}), (3, {"val/reward": 0.2}), (4, {"val/reward": 0.5})]
    ]
    context = CheckpointRetentionContext(current_step=6, checkpoints=infos)
    assert set(keep_recent_and_top(recent=1, top=1)(context)) == {4, 1}
    assert set(keep_recent_and_top(recent=0, top=2)(context)) == {1, 4}
    assert set(keep_recent_and_top(recent=0, top=0)(context)) == set()
    assert set(keep_recent_and_top(recent=9, top=0)(context)) == {1, 2, 3, 4}, (
        "fewer offered than recent: all kept"
    )
    with pytest.raises(ValueError, match="counts, >= 0"):
        keep_recent_and_top(recent=-1)
    assert art.pipeline_trainer.PipelineRuntimeConfig is art.PipelineRuntimeConfig
