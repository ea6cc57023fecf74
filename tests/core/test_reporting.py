"""Row listeners on `model.reporting`: called with each recorded history row, held weakly, never fatal."""

import gc
import warnings
import weakref

import pytest

import artnb as art


def group(*rewards: float) -> art.TrajectoryGroup:
    return art.TrajectoryGroup(
        [art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=r) for r in rewards]
    )


class Seen:
    def __init__(self) -> None:
        self.steps: list[int] = []

    def row(self, row: dict) -> None:
        self.steps.append(row["step"])


async def test_row_listeners_hear_each_row_while_their_object_lives(tmp_path):
    model = art.Model(name="m", project="p", base_path=str(tmp_path))
    seen, gone, functions = Seen(), Seen(), []
    model.reporting.on_row(seen.row)
    model.reporting.on_row(gone.row)
    model.reporting.on_row(lambda row: functions.append(row["val/reward"]))  # not a method: kept as given
    await model.log(group(1.0, 0.0), step=0)
    assert gone.steps == [0]
    gone_ref = weakref.ref(gone)
    del gone  # a plot nobody shows any more: the model does not keep it alive
    gc.collect()
    assert gone_ref() is None
    await model.log(group(1.0, 1.0), step=1)
    assert seen.steps == [0, 1] and functions == [0.5, 1.0]


async def test_a_failing_row_listener_warns_once_and_logging_goes_on(tmp_path):
    model = art.Model(name="m", project="p", base_path=str(tmp_path))
    after = Seen()

    def broken(row: dict) -> None:
        raise KeyError("train/reward")

    model.reporting.on_row(broken)
    model.reporting.on_row(after.row)
    with pytest.warns(UserWarning, match=r"row listener .*broken failed on step 0 \(KeyError"):
        await model.log(group(1.0, 0.0), step=0)
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        await model.log(group(1.0, 0.0), step=1)
    assert not [w for w in later if "broken" in str(w.message)]  # warned once, called still
    assert after.steps == [0, 1] and list(model.history()["step"]) == [0, 1]
