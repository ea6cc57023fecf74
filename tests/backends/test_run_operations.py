"""`model.delete_checkpoints(best_checkpoint_metric)`: keeps the latest and the best step by that metric; refuses,
deleting nothing, a near miss of a metric the history has (a typo would keep only the latest, deleting the best);
keeps only the latest, as ART does, for a metric not logged yet."""

from __future__ import annotations

import pytest
from tiny_loop import gather

import artnb as art
from artnb.pipeline_trainer import keep_recent_and_top

CONFIG = art.TrainConfig(learning_rate=1e-2)


@pytest.fixture
async def three_steps(tmp_path):
    """A run of the tiny model trained 3 steps, with `val/acc` logged best at step 1."""
    model = art.TrainableModel(name="agent", project="ops", base_model=art.models.tiny())
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        for step, acc in enumerate([0.2, 0.9, 0.5]):
            await model.log(metrics={"val/acc": acc}, step=step)
            await model.train(await gather(model, step), config=CONFIG)
        yield model


async def test_a_metric_the_history_lacks_deletes_nothing_and_names_the_close_ones(three_steps):
    model = three_steps
    for typo in ("val/accuracy", "val/ac"):
        with pytest.raises(ValueError, match=rf"no '{typo}'.*nothing was deleted. Did you mean 'val/acc'"):
            await model.delete_checkpoints(typo)
    assert model.store.steps() == [0, 1, 2, 3]


async def test_a_retention_strategy_with_a_near_miss_metric_deletes_nothing(three_steps):
    """PipelineTrainer's `checkpoint_retention_strategy=keep_recent_and_top(metric=...)` holds the same rule."""
    model = three_steps
    backend = model.backend()
    with pytest.raises(
        ValueError, match=r"keep_recent_and_top\(metric='val/accuracy'\).*Did you mean 'val/acc'"
    ):
        await backend._retain_checkpoints(model, keep_recent_and_top(recent=1, metric="val/accuracy"), 3, ())
    assert model.store.steps() == [0, 1, 2, 3]
    assert await backend._retain_checkpoints(
        model, keep_recent_and_top(recent=1, top=1, metric="val/acc"), 3, ()
    ) == [0]


async def test_a_metric_not_logged_yet_keeps_the_latest_as_in_art(three_steps):
    """ART's art-e notebook: `val/correct` exists only once a validation game was answered."""
    model = three_steps
    with pytest.warns(UserWarning, match="no 'val/correct' in the history; keeping only the latest"):
        assert await model.delete_checkpoints("val/correct") == [0, 1, 2]


async def test_the_latest_and_the_best_by_the_metric_are_kept(three_steps):
    model = three_steps
    assert await model.delete_checkpoints("val/acc") == [0, 2]
    assert model.store.steps() == [1, 3]


async def test_without_validation_logged_the_default_metric_keeps_the_latest_as_in_art(tmp_path):
    model = art.TrainableModel(name="agent", project="ops", base_model=art.models.tiny())
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        await model.train(await gather(model, 0), config=CONFIG)
        with pytest.warns(UserWarning, match="no 'val/reward' in the history; keeping only the latest"):
            assert await model.delete_checkpoints() == [0]
        assert model.store.steps() == [1]
