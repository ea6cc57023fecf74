import json
import os

import pandas as pd
import pytest
from pydantic import BaseModel

import artnb as art
from artnb.core.store import RunStore


def _adapter(tmp):
    (tmp / "adapter_config.json").write_text("{}")
    (tmp / "adapter_model.safetensors").write_bytes(b"x")


def _group(*rewards):
    return art.TrajectoryGroup(
        [
            art.Trajectory(messages_and_choices=[{"role": "user", "content": str(r)}], reward=r)
            for r in rewards
        ]
    )


def test_step_is_newest_committed_checkpoint_and_recover_removes_unfinished_ones(tmp_path):
    store = RunStore(tmp_path, "p", "m")
    assert store.latest_step() is None
    store.write_checkpoint(0, _adapter)
    store.write_checkpoint(1, _adapter)
    # a process killed mid-write leaves a temp dir (and older artnb a numbered dir without the adapter files)
    (store.checkpoints / ".0002-abc").mkdir()
    (store.checkpoints / "0002").mkdir()
    (store.checkpoints / "0002" / "adapter_config.json").write_text("{}")
    assert store.latest_step() == 1
    report = store.recover()
    assert not (store.checkpoints / ".0002-abc").exists()
    assert len(report) == 1 and "removed checkpoint 0002" in report[0] and "never committed" in report[0]
    assert store.recover() == []  # reported once


def test_failed_writer_leaves_nothing(tmp_path):
    store = RunStore(tmp_path, "p", "m")

    def broken(tmp):
        (tmp / "adapter_config.json").write_text("{}")
        raise OSError("disk full")

    with pytest.raises(OSError):
        store.write_checkpoint(3, broken)
    assert store.steps() == [] and [p.name for p in store.checkpoints.iterdir()] == []


def test_a_committed_checkpoint_is_never_replaced(tmp_path):
    store = RunStore(tmp_path, "p", "m")
    store.write_checkpoint(1, _adapter)
    with pytest.raises(FileExistsError, match="one writer"):
        store.write_checkpoint(1, _adapter)


def test_commit_publishes_rollouts_and_row_once(tmp_path):
    store = RunStore(tmp_path, "p", "m")
    store.write_checkpoint(0, _adapter)
    commit = store.commit_step(0, _adapter, {"split": "train", "train/reward": 0.5}, [_group(0.0, 1.0)])
    assert store.steps() == [0, 1] and commit.checkpoint == 1
    assert (store.checkpoint_path(1) / "rollouts.parquet").exists()  # committed, not yet published
    assert store.history().empty
    assert store.publish(1) is True
    assert store.publish(1) is False  # idempotent
    assert [t.reward for t in store.read_trajectories("train", 0)[0]] == [0.0, 1.0]
    hist = store.history()
    assert len(hist) == 1 and hist.iloc[0]["step"] == 0 and hist.iloc[0]["commit"] == commit.id
    # a copy forward (equal rewards): the adapter of step 1 with its own rollouts and row
    store.commit_step(1, None, {"split": "train"}, [_group(1.0, 1.0)])
    assert store.publish_pending() == [2]
    assert (store.checkpoint_path(2) / "adapter_model.safetensors").read_bytes() == b"x"
    assert list(store.history()["step"]) == [0, 1]


def test_recover_publishes_a_commit_whose_publication_was_cut_short(tmp_path):
    store = RunStore(tmp_path, "p", "m")
    store.write_checkpoint(0, _adapter)
    store.commit_step(0, _adapter, {"split": "train"}, [_group(0.0, 1.0)])
    # killed after the history row was appended but before the pending rollouts were removed
    commit = store.read_commit(1)
    store.append_history(commit.history)
    report = store.recover()
    assert "published step 0" in report[0]
    assert len(store.history()) == 1  # not appended twice
    assert len(store.read_trajectories("train", 0)[0]) == 2


def test_torn_history_line_is_skipped_with_its_line_number_and_the_next_row_is_kept(tmp_path):
    store = RunStore(tmp_path, "p", "m")
    store.append_history({"step": 0, "split": "train", "train/reward": 0.1})
    with open(store.history_path, "a") as f:
        f.write('{"step": 1, "split": "tr')  # a write cut short by a crash
    with pytest.warns(UserWarning, match="line 2 is damaged"):
        assert list(store.history()["step"]) == [0]
    store.append_history({"step": 1, "split": "train", "train/reward": 0.2})
    with pytest.warns(UserWarning, match="line 2 is damaged"):
        hist = store.history()
    assert list(hist["step"]) == [0, 1] and list(hist["train/reward"]) == [0.1, 0.2]


@pytest.mark.parametrize(
    "bad", ["../../../x", "/abs", "", ".", "..", "a/b", "a\\b", "x@3", " lead", "trail ", "ok."]
)
def test_project_and_name_must_be_single_safe_folder_names(tmp_path, bad):
    with pytest.raises(ValueError, match="is not allowed: it names a folder"):
        art.TrainableModel(name=bad, project="p", base_model="m")
    with pytest.raises(ValueError, match="project=.* is not allowed"):
        art.Model(name="ok", project=bad)
    with pytest.raises(ValueError, match="is not allowed"):
        RunStore(tmp_path, "p", bad)
    model = art.Model(name="agent-001", project="tic-tac-toe v2")
    with pytest.raises(ValueError, match="is not allowed"):
        model.name = bad  # assignment is checked too
    assert not any(p.name != "p" for p in tmp_path.iterdir())


def test_one_writer_lock_names_its_holder(tmp_path):
    store = RunStore(tmp_path, "p", "m")
    lock = store.lock()
    with pytest.raises(art.RunInUseError, match=rf"this process \({os.getpid()}\)"):
        store.lock()
    assert store.holder()["pid"] == os.getpid()
    lock.release()
    store.lock().release()


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


def test_additional_histories_come_back_from_the_run_directory(tmp_path):
    """A self-play or sub-agent rollout's other conversations are part of what was trained: the group view of an
    old step shows them, so they are written with the trajectory (and files written before still read)."""
    opponent = art.History(
        messages_and_choices=[
            {"role": "user", "content": "your move"},
            {"role": "assistant", "content": "b2"},
        ],
        tools=[{"type": "function", "function": {"name": "move"}}],
    )
    played = art.Trajectory(
        messages_and_choices=[{"role": "user", "content": "a1?"}], reward=1.0, additional_histories=[opponent]
    )
    plain = art.Trajectory(messages_and_choices=[{"role": "user", "content": "c3?"}], reward=0.0)
    store = RunStore(tmp_path, "p", "m")
    store.write_trajectories("train", 0, [art.TrajectoryGroup([played, plain])])
    back = store.read_trajectories("train", 0)[0].trajectories
    assert [m["content"] for m in back[0].additional_histories[0].messages()] == ["your move", "b2"]
    assert back[0].additional_histories[0].tools == opponent.tools and back[1].additional_histories == []

    path = store.trajectories_path("train", 1)  # a file from before: no such column
    pd.read_parquet(store.trajectories_path("train", 0)).drop(columns="additional_histories").to_parquet(path)
    store.write_trajectories("train", 1, [art.TrajectoryGroup([played, plain])])  # appended to since
    groups = store.read_trajectories("train", 1)
    assert [len(t.additional_histories) for g in groups for t in g.trajectories] == [0, 0, 1, 0]


def test_state_merge(tmp_path):
    model = art.Model(name="m", project="p", base_path=str(tmp_path))
    model.overwrite_state({"a": {"x": 1}, "b": 1})
    model.merge_state({"a": {"y": 2}})
    assert model.read_state() == {"a": {"x": 1, "y": 2}, "b": 1}
    assert json.loads(model.store.state_path.read_text())["b"] == 1


def test_state_helpers_as_art_has_them(tmp_path):
    """ART 0.5: read_state() is None before anything was saved, merge_state returns what it saved, and the
    deprecated write_state replaces the state (warning which call to use)."""
    model = art.Model(name="m", project="p", base_path=str(tmp_path))
    assert model.read_state() is None
    assert model.merge_state({"a": {"x": 1}}) == {"a": {"x": 1}}
    assert model.merge_state({"a": {"y": 2}}) == {"a": {"x": 1, "y": 2}} == model.read_state()
    with pytest.warns(DeprecationWarning, match="overwrite_state"):
        model.write_state({"b": 1})
    assert model.read_state() == {"b": 1}


async def test_backend_and_safe_model_dump(tmp_path):
    class Cfg(BaseModel):
        turns: int = 3

    model = art.Model(name="m", project="p", base_path=str(tmp_path), config=Cfg())
    with pytest.raises(ValueError, match=r"not registered.*await model.register\(backend\)"):
        model.backend()
    dumped = model.safe_model_dump()
    assert dumped["config"] is None and dumped["name"] == "m" and model.config == Cfg()
    backend = art.LocalBackend(path=tmp_path)
    await model.register(backend)
    assert model.backend() is backend
    await backend.close()


def test_nan_reward_is_named():
    from artnb.core.trajectory import check_trajectories

    g = art.TrajectoryGroup([art.Trajectory(reward=1.0), art.Trajectory(reward=float("nan"))])
    with pytest.raises(ValueError, match="group 0, trajectory 1 has reward nan"):
        check_trajectories([g])


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


@pytest.mark.parametrize("split", ["../x", "a/b", "..", "", None])
def test_trajectory_paths_never_leave_the_run_directory(tmp_path, split):
    store = art.Model(name="m", project="p", base_path=str(tmp_path)).store
    with pytest.raises((TypeError, ValueError), match="split"):
        store.trajectories_path(split, 0)
    with pytest.raises(TypeError, match="step must be a whole number"):
        store.trajectories_path("val", "1")
    assert (
        store.trajectories_dir(".ipynb_checkpoints").parent == store.dir / "trajectories"
    )  # listed, not written
