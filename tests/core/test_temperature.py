"""ART's temperature annealing (`model.set_temperature_annealer(art.LinearTemperatureAnnealer(...))`): the schedule,
and the default temperature it gives the model's engine at register and after each train, kept when the engine
restarts. ART's examples/remote_backend/remote_2048.py sets one before register."""

from __future__ import annotations

import asyncio
import doctest
import os
import signal

import pytest
from tiny_loop import gather

import artnb as art
from artnb.core import temperature
from artnb.local import LocalBackend
from artnb.models import tiny


def test_the_schedule_goes_from_start_to_end_in_equal_moves_then_stays():
    assert doctest.testmod(temperature).failed == 0
    annealer = art.LinearTemperatureAnnealer(start=1.0, end=0.1, steps=5)
    assert [round(annealer.step(), 3) for _ in range(7)] == [1.0, 0.775, 0.55, 0.325, 0.1, 0.1, 0.1]
    rising = art.LinearTemperatureAnnealer(start=0.2, end=1.0, steps=1)
    assert [rising.step(), rising.step()] == [0.2, 1.0]


def test_a_schedule_outside_what_sampling_takes_is_refused_by_name():
    with pytest.raises(ValueError, match="start=2.5: a sampling temperature is between 0 and 2"):
        art.LinearTemperatureAnnealer(start=2.5, end=0.1, steps=5)
    with pytest.raises(ValueError, match="steps=0: the schedule needs at least 1 step"):
        art.LinearTemperatureAnnealer(start=1.0, end=0.1, steps=0)
    model = art.TrainableModel(name="m", project="p", base_model="x")
    with pytest.raises(
        TypeError, match=r"an annealer with a step\(\) method, e\.g\. art\.LinearTemperatureAnnealer"
    ):
        model.set_temperature_annealer(0.5)  # type: ignore[arg-type]


async def test_the_engine_samples_at_the_schedule_each_train_moves_it_and_a_restart_keeps_it(tmp_path):
    model = art.TrainableModel(
        name="anneal", project="p", base_model=tiny(hidden_size=64, num_layers=2, seed=1)
    )
    assert model.default_temperature is None
    model.set_temperature_annealer(
        art.LinearTemperatureAnnealer(start=1.0, end=0.2, steps=3)
    )  # as ART: first
    assert model.default_temperature == 1.0
    async with LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        assert (await backend.engine_of(model).stats())["default_temperature"] == 1.0
        await model.train(await gather(model, seed=1), learning_rate=1e-2)
        assert model.default_temperature == pytest.approx(0.6)
        assert (await backend.engine_of(model).stats())["default_temperature"] == pytest.approx(0.6)

        os.kill(backend.engine_of(model).pid, signal.SIGKILL)  # type: ignore[attr-defined]
        await gather(model, seed=2)  # the next request restarts the engine
        assert (await backend.engine_of(model).stats())["default_temperature"] == pytest.approx(0.6)

        await backend.train(
            model, await gather(model, seed=3), learning_rate=1e-2
        )  # ART's spelling moves it too
        assert (await backend.engine_of(model).stats())["default_temperature"] == pytest.approx(0.2)
        model.set_temperature_annealer(art.LinearTemperatureAnnealer(start=0.0, end=0.0, steps=1))
        await model._temperature_task  # set after register: sent as soon as this coroutine yields
        assert (await backend.engine_of(model).stats())["default_temperature"] == 0.0


def test_an_annealer_set_in_a_script_outside_any_event_loop_reaches_the_engine_at_once(tmp_path):
    """A script that calls asyncio.run once per phase: set between two of them, the schedule is sent before
    set_temperature_annealer returns (it used to wait for the next train, with a warning)."""
    model = art.TrainableModel(
        name="script", project="p", base_model=tiny(hidden_size=64, num_layers=2, seed=1)
    )
    backend = LocalBackend(path=tmp_path, engine="hf")
    asyncio.run(model.register(backend))
    try:
        model.set_temperature_annealer(art.LinearTemperatureAnnealer(start=0.3, end=0.2, steps=3))
        assert asyncio.run(backend.engine_of(model).stats())["default_temperature"] == pytest.approx(0.3)
    finally:
        asyncio.run(backend.close())
