import json

import pytest

import artnb as art
from artnb.core.store import RunStore


def _adapter(tmp):
    (tmp / "adapter_config.json").write_text("{}")
    (tmp / "adapter_model.safetensors").write_bytes(b"x")


def test_step_is_newest_complete_checkpoint(tmp_path):
    store = RunStore(tmp_path, "p", "m")
    assert store.latest_step() is None
    store.write_checkpoint(0, _adapter)
    store.write_checkpoint(1, _adapter)
    # a process killed mid-write leaves a temp dir and possibly a numbered dir without the adapter files
    (store.checkpoints / ".0002-abc").mkdir()
    (store.checkpoints / "0002").mkdir()
    (store.checkpoints / "0002" / "adapter_config.json").write_text("{}")
    assert store.latest_step() == 1
    store.clean_partial_checkpoints()
    assert not (store.checkpoints / ".0002-abc").exists()


def test_failed_writer_leaves_nothing(tmp_path):
    store = RunStore(tmp_path, "p", "m")

    def broken(tmp):
        (tmp / "adapter_config.json").write_text("{}")
        raise OSError("disk full")

    with pytest.raises(OSError):
        store.write_checkpoint(3, broken)
    assert store.steps() == [] and [p.name for p in store.checkpoints.iterdir()] == []


def test_copy_checkpoint_advances(tmp_path):
    store = RunStore(tmp_path, "p", "m")
    store.write_checkpoint(0, _adapter)
    store.copy_checkpoint(0, 1)
    assert store.steps() == [0, 1]


async def test_model_log_writes_history_and_parquet(tmp_path):
    model = art.Model(name="m", project="p", base_path=str(tmp_path))
    group = art.TrajectoryGroup(
        [
            art.Trajectory(
                messages_and_choices=[{"role": "user", "content": "a"}], reward=1.0, metrics={"win": True}
            ),
            art.Trajectory(
                messages_and_choices=[{"role": "user", "content": "b"}], reward=0.0, metrics={"win": False}
            ),
        ]
    )
    row = await model.log([group], split="val", metrics={"custom": 2.0}, step=3)
    assert row["val/reward"] == 0.5 and row["val/reward_std_dev"] == 0.5 and row["val/win"] == 0.5
    assert row["val/custom"] == 2.0
    hist = model.history()
    assert hist.iloc[0]["step"] == 3 and hist.iloc[0]["val/reward"] == 0.5
    again = model.store.read_trajectories("val", 3)
    assert [t.reward for t in again[0]] == [1.0, 0.0]
    assert again[0][0].messages()[0]["content"] == "a"
    await model.log([group], split="val", step=3)  # a second log at the same step appends, keeps both
    assert len(model.store.read_trajectories("val", 3)) == 2


def test_state_merge(tmp_path):
    model = art.Model(name="m", project="p", base_path=str(tmp_path))
    model.overwrite_state({"a": {"x": 1}, "b": 1})
    model.merge_state({"a": {"y": 2}})
    assert model.read_state() == {"a": {"x": 1, "y": 2}, "b": 1}
    assert json.loads(model.store.state_path.read_text())["b"] == 1


def test_nan_reward_is_named():
    from artnb.core.trajectory import check_rewards

    g = art.TrajectoryGroup([art.Trajectory(reward=1.0), art.Trajectory(reward=float("nan"))])
    with pytest.raises(ValueError, match="group 0, trajectory 1 has reward nan"):
        check_rewards([g])


def test_model_without_endpoint_says_what_to_do():
    with pytest.raises(RuntimeError, match="inference_base_url"):
        art.Model(name="x").openai_client()
    with pytest.raises(RuntimeError, match="register"):
        art.TrainableModel(name="x", base_model="y").openai_client()


def test_base_model_path_that_does_not_exist():
    from artnb.models import resolve_base_model

    with pytest.raises(FileNotFoundError, match="not an existing model directory"):
        resolve_base_model("./no/such/model")
    assert resolve_base_model("Qwen/Qwen2.5-3B-Instruct") == "Qwen/Qwen2.5-3B-Instruct"
