"""TrainingLoop on a tiny served model: phases, events, pending groups, stop between phases, busy guard."""

import asyncio

import pytest
from tiny_loop import tiny_model_served

import artnb as art
from artnb.core.loop import LoopBusy, TrainingLoop
from artnb.tasks import tic_tac_toe


@pytest.fixture(scope="module")
async def model(tmp_path_factory):
    async with tiny_model_served(tmp_path_factory.mktemp("art"), "loop") as model:
        yield model


def recorder(loop: TrainingLoop) -> list:
    events = []
    loop.on(events.append)
    return events


async def bonus(group: art.TrajectoryGroup) -> art.TrajectoryGroup:
    """A user's scorer: +1 for the first trajectory of each group, so GRPO has something to learn."""
    out = group.model_copy(deep=True)
    out[0].reward += 1.0
    return out


async def test_gather_score_train_one_phase_at_a_time(model):
    loop = TrainingLoop(
        model, tic_tac_toe.rollout, lambda step: [step, step + 100], group_size=2, score=bonus
    )
    events = recorder(loop)
    start = await model.get_step()
    groups = await loop.gather()
    assert len(groups) == 2 and all(len(g) == 2 for g in groups) and loop.pending == groups
    assert [g.metadata["scenario"] for g in groups] == [start, start + 100]
    progress = [(e.done, e.total) for e in events if e.kind == "progress"]
    assert progress[0] == (0, 4) and progress[-1] == (4, 4)
    assert [e.phase for e in events if e.kind == "phase"] == ["gather", "idle"]

    before = [g.rewards() for g in groups]
    scored = await loop.score()
    assert loop.pending_scored and [g.rewards()[0] for g in scored] == [b[0] + 1 for b in before]

    events.clear()
    result = await loop.train()
    assert result.step == start + 1 == await model.get_step()
    assert loop.pending == [] and loop.last_groups == scored and loop.last_result is result
    assert [(e.kind, e.phase) for e in events][:2] == [("phase", "train"), ("progress", "train")]
    assert [e.kind for e in events][-3:] == ["progress", "trained", "phase"] and events[-1].phase == "idle"
    assert events[-3].done == events[-3].total > 0  # the train bar ends full
    assert loop.train_estimate_s() > 0
    assert model.history()["train/reward"].iloc[-1] == pytest.approx(
        sum(sum(g.rewards()) for g in scored) / 4
    )


async def test_stop_after_the_current_phase_keeps_what_was_gathered(model):
    loop = TrainingLoop(model, tic_tac_toe.rollout, [1], group_size=2)
    events = recorder(loop)
    loop.on(lambda e: loop.stop() if e.kind == "groups" else None)
    start = await model.get_step()
    assert await loop.run(3) == []  # stopped right after the first gather
    assert len(loop.pending) == 1 and await model.get_step() == start
    assert events[-1].kind == "stopped" and not loop.busy and not loop.stop_requested

    loop._listeners.pop()  # no more stopping
    gathers = sum(e.kind == "groups" for e in events)
    result = await loop.step()  # trains the kept groups without gathering again
    assert result.step == start + 1 and sum(e.kind == "groups" for e in events) == gathers

    loop.on(lambda e: loop.stop() if e.kind == "trained" else None)
    results = await loop.run(3)
    assert [r.step for r in results] == [start + 2]


async def test_one_action_at_a_time_and_clear_errors(model):
    loop = TrainingLoop(model, tic_tac_toe.rollout, lambda step: [], group_size=2)
    with pytest.raises(ValueError, match="no scenarios for step"):
        await loop.gather()
    assert loop.phase == "idle" and not loop.busy
    with pytest.raises(ValueError, match="nothing to train on: gather first"):
        await loop.train()
    with pytest.raises(ValueError, match="no scorer: pass score="):
        await loop.score()
    with pytest.raises(ValueError, match="use >= 2"):
        TrainingLoop(model, tic_tac_toe.rollout, [0], group_size=1)

    loop = TrainingLoop(model, tic_tac_toe.rollout, [0], group_size=2)
    running = asyncio.ensure_future(loop.gather())
    await asyncio.sleep(0)
    with pytest.raises(LoopBusy, match="busy"):
        await loop.train()
    await running
    loop.stop()  # idle: nothing to stop, and the next action is not affected
    assert not loop.stop_requested


async def test_engine_state(model):
    loop = TrainingLoop(model, tic_tac_toe.rollout, [0], group_size=2)
    assert await loop.engine_state() == f"serving loop at step {await model.get_step()}"
    unregistered = art.TrainableModel(name="nobody", base_model=art.models.tiny())
    state = await TrainingLoop(unregistered, tic_tac_toe.rollout, [0], group_size=2).engine_state()
    assert state.startswith("not registered")


async def test_a_failing_listener_warns_once_and_the_loop_reaches_its_own_error(model):
    async def nan_reward(model, scenario):
        return art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=float("nan"))

    def broken_view(event):
        raise AttributeError("'float' object has no attribute 'numerator'")

    loop = TrainingLoop(model, nan_reward, [0], group_size=2)
    loop.on(broken_view)
    events = recorder(loop)
    with pytest.warns(UserWarning) as warned:
        groups = await loop.gather()
        with pytest.raises(ValueError, match="rewards must be finite numbers"):
            await loop.train()
    assert len(groups) == 1 and loop.pending == groups  # the gather finished despite the broken view
    assert [e.kind for e in events].count("groups") == 1  # listeners after the broken one still heard
    mine = [str(w.message) for w in warned if "broken_view" in str(w.message)]
    assert len(mine) == 1 and "AttributeError: 'float' object has no attribute 'numerator'" in mine[0]
    assert loop.phase == "idle" and not loop.busy
