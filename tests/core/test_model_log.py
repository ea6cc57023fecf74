"""`model.log` and `model.train` refuse what they cannot record or train, naming the problem and the fix, before
anything is written: history.jsonl is append-only, so one bad row would stay for the life of the run."""

import asyncio
import math

import numpy as np
import pytest
from pydantic import BaseModel

import artnb as art
from artnb.local import LocalBackend
from artnb.models import tiny


def traj(reward=1.0, **kwargs):
    return art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=reward, **kwargs)


def group(*rewards):
    return art.TrajectoryGroup([traj(r) for r in rewards or (1.0, 0.0)])


def files_under(path):
    return sorted(p.relative_to(path) for p in path.rglob("*") if p.is_file())


@pytest.fixture
def model(tmp_path):
    return art.Model(name="gpt", project="p", base_path=str(tmp_path / "runs"))


def _pending_group():
    """A group whose rollouts have not run (futures: left un-awaited, they warn of nothing)."""
    loop = asyncio.get_running_loop()
    return art.TrajectoryGroup([loop.create_future(), loop.create_future()])


@pytest.mark.parametrize(
    "batch, got, fix",
    [
        (lambda: [_pending_group()], "PendingGroup at index 0", "await the group first"),
        (_pending_group, "got PendingGroup", "await the group first"),
        (lambda: [[traj(), traj()]], "list at index 0", r"wrap trajectories in art\.TrajectoryGroup"),
        (lambda: [{"reward": 1}], "dict at index 0", r"art\.Trajectory\(messages_and_choices"),
        (lambda: traj(), "one Trajectory", r"model\.log\(\[trajectory\]\)"),
        (lambda: {"accuracy": 1.0}, "got dict", r"model\.log\(metrics="),
    ],
)
async def test_log_refuses_what_it_would_drop_naming_the_type_and_the_fix(model, tmp_path, batch, got, fix):
    with pytest.raises(TypeError, match=rf"model\.log takes a list of art\.TrajectoryGroup.*{got}.*{fix}"):
        await model.log(batch(), step=1)
    assert files_under(tmp_path) == []


async def test_log_keeps_arts_forms(model):
    g1, g2 = group(1.0, 0.0), group(0.5, 0.5)
    assert (await model.log([g1, g2], step=0))["val/num_trajectories"] == 4
    assert (await model.log(g1, step=1))["val/num_trajectories"] == 2  # one group, as ART iterates it
    row = await model.log([traj(1.0), ValueError("boom")], step=2)  # trajectories and failures: one group
    assert row["val/num_trajectories"] == 1 and row["val/exception_rate"] == 0.5
    assert (await model.log(metrics={"accuracy": np.float32(0.5)}, step=3))["val/accuracy"] == 0.5
    assert (await model.log(None, metrics={"n": np.int64(3), "ok": True}, step=4))["val/n"] == 3
    assert list(model.history()["step"]) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    "split, error, match",
    [
        (
            "../../../escape",
            ValueError,
            r"split='\.\./\.\./\.\./escape' is not allowed.*For example 'escape'",
        ),
        ("", ValueError, r"split='' is not allowed.*For example 'val'"),
        ("val\n", ValueError, r"split='val\\n' is not allowed"),
        (None, TypeError, r"split must be a string.*\(got NoneType None\); pass e\.g\. split='val'"),
        (5, TypeError, r"split must be a string.*\(got int 5\)"),
    ],
)
async def test_log_refuses_a_split_that_cannot_name_a_folder_before_writing(
    model, tmp_path, split, error, match
):
    with pytest.raises(error, match=match):
        await model.log([group()], split=split, step=1)
    assert files_under(tmp_path) == []


@pytest.mark.parametrize(
    "step, error, match",
    [
        ("a", TypeError, r"step must be a whole number >= 0 \(got str 'a'\); pass an int"),
        (1.5, TypeError, r"\(got float 1\.5\)"),
        (True, TypeError, r"\(got bool True\)"),
        (-1, ValueError, r"step must be >= 0 \(got -1\); pass the training step"),
    ],
)
async def test_log_refuses_a_step_that_is_not_a_whole_number(model, tmp_path, step, error, match):
    with pytest.raises(error, match=match):
        await model.log([group()], step=step)
    assert files_under(tmp_path) == []
    assert (await model.log([group()], step=np.int64(2)))["step"] == 2  # a numpy integer is a step


@pytest.mark.parametrize(
    "metrics, match",
    [
        ({"acc": "n/a"}, r"metrics\['acc'\] must be a number \(got str 'n/a'\); log an int, float or bool"),
        ({"ok": 1.0, "acc": [1, 2]}, r"metrics\['acc'\] must be a number \(got list"),
        ([("acc", 1)], r"metrics must be a dict .*\(got list\); pass e\.g\. .*dict\(pairs\)"),
        ({1: 0.5}, r"metric names must be non-empty strings \(got 1\)"),
    ],
)
async def test_log_refuses_metrics_that_are_not_numbers_and_writes_nothing(model, tmp_path, metrics, match):
    await model.log([group()], step=0)
    before = model.store.history_path.read_text()
    with pytest.raises(TypeError, match=match):
        await model.log(metrics=metrics, step=1)
    assert model.store.history_path.read_text() == before


@pytest.mark.parametrize(
    "spoil, match",
    [
        (lambda t: setattr(t, "reward", None), r"has reward None; rewards must be numbers \(got NoneType\)"),
        (lambda t: setattr(t, "reward", "1"), r"has reward '1'; rewards must be numbers \(got str\)"),
        (
            lambda t: t.metrics.update(winner="x"),
            r"group 0, trajectory 1 has metrics\['winner'\] = 'x' \(got str\).*metadata\['winner'\]",
        ),
        (lambda t: t.metrics.update(winner=None), r"metrics\['winner'\] = None \(got NoneType\)"),
    ],
)
async def test_log_refuses_bad_rewards_and_metrics_set_after_construction(model, tmp_path, spoil, match):
    g = group(1.0, 0.0)
    spoil(g.trajectories[1])
    with pytest.raises(ValueError, match=match):
        await model.log([g], step=0)
    assert files_under(tmp_path) == []


@pytest.mark.parametrize("odd", [math.nan, math.inf, 5e12])
async def test_a_reward_training_could_not_use_is_still_logged_and_left_out_of_the_mean(model, odd):
    """A validation game that scored NaN, or a comparison model's huge score: recorded as ART records it (the
    training checks are for training); the mean reward is over the finite ones."""
    g = group(1.0, 0.0, odd)
    row = await model.log([g], step=0)
    expected = 0.5 if not math.isfinite(odd) else (1.0 + odd) / 3
    assert row["val/reward"] == pytest.approx(expected)
    assert len(model.store.read_trajectories("val", 0)[0].trajectories) == 3


async def test_numpy_rewards_and_metrics_are_logged_as_plain_numbers(model):
    g = group(1.0, 0.0)
    g.trajectories[0].reward = np.float32(0.25)
    g.trajectories[0].metrics["turns"] = np.int64(3)
    row = await model.log([g], step=0)
    assert row["val/reward"] == pytest.approx(0.125)
    assert type(g.trajectories[0].reward) is float and type(g.trajectories[0].metrics["turns"]) is int
    assert model.store.read_trajectories("val", 0)[0].trajectories[0].reward == 0.25


def test_a_dict_config_is_refused_at_construction_with_the_fix():
    for make in (art.Model, lambda **kw: art.TrainableModel(base_model="x", **kw)):
        with pytest.raises(
            TypeError, match=r"config must be an instance of your own pydantic model \(got dict\)"
        ):
            make(name="a", config={"max_turns": 5})

    class GameConfig(BaseModel):
        max_turns: int = 5

    assert art.Model(name="a", config=GameConfig()).config == GameConfig()
    typed = art.Model[GameConfig](name="a", config={"max_turns": 7})  # a parametrised model validates dicts
    assert typed.config == GameConfig(max_turns=7) and "max_turns=7" in repr(typed)


async def test_train_says_how_to_fix_its_arguments_before_anything_runs():
    model = art.TrainableModel(name="m", project="p", base_model="x")  # not registered: nothing could run
    with pytest.raises(
        TypeError, match=r"\(got one TrajectoryGroup\); wrap it in a list: model\.train\(\[group\]\)"
    ):
        await model.train(group())
    with pytest.raises(
        TypeError, match=r"\(got list at index 0\); wrap trajectories in art\.TrajectoryGroup"
    ):
        await model.train([[traj(), traj()]])
    for config in ({"learning_rate": 1e-5}, art.dev.TrainConfig(learning_rate=1e-5)):
        with pytest.raises(
            TypeError, match=r"config takes art\.TrainConfig\(\.\.\.\) \(got dict\); .*go to `_config=`"
        ):
            await model.train([group()], config)
    with pytest.raises(TypeError, match=r"_config takes ART's dev settings as a dict \(got TrainConfig\)"):
        await model.train([group()], _config=art.TrainConfig())
    with pytest.raises(RuntimeError, match="register"):  # valid arguments get as far as the backend
        await model.train((g for g in [group()]), art.TrainConfig(), _config={"learning_rate": 1e-5})


async def test_a_bad_metric_fails_train_before_the_trainer_runs(tmp_path, monkeypatch):
    from artnb.backends import step_kinds

    calls = []

    async def trainer_ran(*args, **kwargs):
        calls.append(1)
        raise AssertionError("the trainer ran")

    monkeypatch.setattr(step_kinds.GRPOStep, "train", trainer_ran)
    model = art.TrainableModel(name="m", project="p", base_model=tiny(hidden_size=64, num_layers=2, seed=1))
    async with LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        groups = [group(1.0, 0.0), group(0.0, 1.0)]
        groups[1].trajectories[0].metrics["winner"] = "x"
        with pytest.raises(
            ValueError, match=r"group 1, trajectory 0 has metrics\['winner'\].*Nothing was trained"
        ):
            await model.train(groups, learning_rate=1e-2)
        assert calls == [] and await model.get_step() == 0 and model.store.steps() == [0]
        assert not model.store.history_path.exists()


async def test_metadata_json_cannot_hold_is_refused_before_anything_is_written(model, tmp_path):
    """A value in metadata that JSON cannot hold would come back as text: refused, naming the key, and the run
    directory stays as it was (nothing half-written)."""
    bad = traj(metadata={"cfg": {"started": object()}})
    with pytest.raises(
        ValueError, match=r"metadata\['cfg'\]\['started'\] of type object.*Nothing was logged"
    ):
        await model.log([art.TrajectoryGroup([traj(), bad])], split="val", step=0)
    assert not (tmp_path / "runs").exists() or files_under(tmp_path / "runs") == []


def test_a_train_request_refuses_metadata_json_cannot_hold_where_it_is_made():
    """Made in the notebook, before a remote backend's wire would turn the value into text on the way."""
    from artnb.core.train_request import SFTRequest, TrainRequest

    bad = traj(metadata={"when": object()})
    with pytest.raises(
        ValueError, match=r"group 1, trajectory 0 has metadata\['when'\].*Nothing was trained"
    ):
        TrainRequest.build([group(), art.TrajectoryGroup([bad, traj(0.0)])], None, {})
    with pytest.raises(ValueError, match=r"trajectory 1 has metadata\['when'\].*Nothing was trained"):
        SFTRequest.build([traj(), bad], None, {})
