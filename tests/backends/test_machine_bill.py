"""`LocalBackend(gpu_cost_per_hour_usd=...)`: each committed step's row says what the machine cost since the last
one, models on one backend never pay for the same hour twice, and a failed step's hours go to the next."""

import time
from fractions import Fraction

import numpy as np
import pytest
from test_local_backend import gather

import artnb as art
from artnb.backends.machine_bill import COST_KEY, HourlyBill, checked_price
from artnb.models import tiny

PER_SECOND = 3600.0  # $1 a second: a row's dollars are its seconds


@pytest.fixture(scope="module")
def base():
    return tiny(hidden_size=64, num_layers=2, seed=1)


async def test_steps_of_two_models_share_one_clock(tmp_path, base):
    first = art.TrainableModel(name="first", project="p", base_model=base)
    second = art.TrainableModel(name="second", project="p", base_model=base)
    config = art.TrainConfig(learning_rate=1e-2)
    started = time.monotonic()
    async with art.LocalBackend(path=tmp_path, engine="hf", gpu_cost_per_hour_usd=PER_SECOND) as backend:
        await first.register(backend)
        await second.register(backend)
        results = [await model.train(await gather(model, 0), config) for model in (first, second, first)]
        up = time.monotonic() - started
    rows = [*first.history().to_dict("records"), *second.history().to_dict("records")]
    assert [row[COST_KEY] for row in rows] == pytest.approx(
        [r.metrics[COST_KEY] for r in (*results[::2], results[1])]
    )
    for row in rows:
        assert row[COST_KEY] >= row["time/step_train_s"]  # the step itself is inside the hours it is billed
    billed = sum(row[COST_KEY] for row in rows)
    assert sum(row["time/step_train_s"] for row in rows) < billed <= up  # no second billed twice


async def test_no_price_no_column(tmp_path, base):
    model = art.TrainableModel(name="free", project="p", base_model=base)
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        result = await model.train(await gather(model, 0), art.TrainConfig(learning_rate=1e-2))
    assert COST_KEY not in result.metrics and COST_KEY not in model.history()


def test_a_step_that_did_not_commit_gives_its_hours_to_the_next():
    bill = HourlyBill(PER_SECOND)
    time.sleep(0.05)
    failed = bill.take()
    assert failed >= 0.05
    bill.give_back(failed)
    assert bill.take() >= failed + 0.0  # carried, plus the moments since
    assert bill.take() < failed  # and only once


@pytest.mark.parametrize("price", [-1.0, float("nan"), float("inf"), "2.5", True])
def test_a_price_that_is_not_dollars_per_hour_is_refused(tmp_path, price):
    with pytest.raises(ValueError, match=r"gpu_cost_per_hour_usd=.*: pass the machine's price in US dollars"):
        art.LocalBackend(path=tmp_path, gpu_cost_per_hour_usd=price)


@pytest.mark.parametrize("price", [0, 2, 2.5, np.float32(2.5), np.int64(3), Fraction(5, 2)])
def test_any_real_number_of_dollars_is_a_price(price):
    """A price read from a table (numpy) or written as a fraction is taken as it is, as a float."""
    assert checked_price(price) == float(price) and type(checked_price(price)) is float
