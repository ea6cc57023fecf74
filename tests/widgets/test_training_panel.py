"""TrainingPanel on a real tiny-model backend: button clicks, state transitions, live plot and group view."""

import asyncio

import artnb as art
from artnb.tasks import tic_tac_toe
from artnb.widgets import TrainingPanel


def buttons(panel: TrainingPanel) -> dict[str, bool]:
    """Which buttons are enabled."""
    named = {
        "gather": panel.gather_button,
        "score": panel.score_button,
        "train": panel.train_button,
        "run": panel.run_button,
        "stop": panel.stop_button,
    }
    return {k: not b.disabled for k, b in named.items()}


async def lucky_first(group: art.TrajectoryGroup) -> art.TrajectoryGroup:
    out = group.model_copy(deep=True)
    out[0].reward += 1.0
    return out


async def test_gather_score_train_from_buttons(served):
    panel = TrainingPanel(
        served, tic_tac_toe.rollout, scenarios=lambda step: [step], group_size=3, score=lucky_first
    )
    await panel.refresh()
    start = panel.step
    assert buttons(panel) == {"gather": True, "score": False, "train": True, "run": True, "stop": False}
    assert f"step <b>{start}</b>" in panel.status.value and "phase: <b>idle</b>" in panel.status.value
    assert f"engine: serving widgets at step {start}" in panel.status.value
    points = sum(panel.plot.points.values())

    panel.gather_button.click()
    assert buttons(panel) == {"gather": False, "score": False, "train": False, "run": False, "stop": True}
    await panel.wait()
    assert (panel.gather_bar.value, panel.gather_bar.max) == (3, 3)
    assert panel.gather_text.value == "3/3 rollouts"
    assert "1 groups gathered, not trained" in panel.status.value
    assert buttons(panel)["score"] and len(panel.group_view.cards) == 3
    assert panel.group_view.group is panel.loop.pending[0]

    panel.score_button.click()
    await panel.wait()
    assert "(scored)" in panel.status.value and panel.gather_text.value == "scored 1/1 groups"

    panel.train_button.click()
    await panel.wait()
    assert panel.step == start + 1 and f"step <b>{start + 1}</b>" in panel.status.value
    assert panel.train_bar.value == 1.0 and panel.train_bar.bar_style == "success"
    assert sum(panel.plot.points.values()) == points + 1
    assert len(panel.off_policy.metrics["train/ratio_std"]) == start + 1  # the ratio spread of every step
    assert "train/steps_off_policy" not in panel.off_policy.metrics  # a synchronous loop has no lag to show
    assert f"trained step {start + 1}" in panel.status.value and "not trained" not in panel.status.value
    assert f"serving widgets at step {start + 1}" in panel.status.value
    assert panel.output.outputs == ()
    # a new panel on the run (as after a kernel restart) shows the newest trained step's groups
    again = TrainingPanel(served, tic_tac_toe.rollout, scenarios=lambda step: [step], group_size=3)
    assert again.group_view.group is not None and len(again.group_view.cards) == 3


async def test_run_n_steps_stop_and_a_responsive_event_loop(served):
    panel = TrainingPanel(served, tic_tac_toe.rollout, scenarios=[3, 4], group_size=2, steps=3)
    start = panel.step
    phases_seen_by_other_tasks, ticking = [], True

    async def ticker():  # another task on the same event loop, as a notebook cell would be
        while ticking:
            await asyncio.sleep(0.01)
            phases_seen_by_other_tasks.append(panel.loop.phase)

    stop_state = []

    def press_stop_when_training_starts(event):
        if event.kind == "phase" and event.phase == "train" and not stop_state:
            stop_state.append(buttons(panel)["stop"])
            panel.stop_button.click()
            stop_state.append(buttons(panel)["stop"])

    panel.loop.on(press_stop_when_training_starts)
    tick = asyncio.ensure_future(ticker())
    panel.run_button.click()
    await panel.wait()
    ticking = False
    await tick
    assert stop_state == [True, False], "Stop is enabled while running and disabled once pressed"
    assert panel.step == start + 1, "Stop, pressed as step 1 started training, ends the run after that phase"
    assert panel.loop.pending == [] and "stopped" in panel.status.value
    assert buttons(panel)["run"] and not buttons(panel)["stop"]
    assert panel.group_view.groups == panel.loop.last_groups and len(panel.group_view.groups) == 2
    assert "last step took" in panel.train_text.value
    # The event loop kept serving other tasks in every phase: nothing blocked it while rollouts and training ran.
    # (A train phase can be over in a few ticks: a batch whose games all tie makes no update.)
    assert phases_seen_by_other_tasks.count("gather") >= 5 and phases_seen_by_other_tasks.count("train") >= 1


async def test_errors_show_in_the_panel_and_leave_it_usable(served):
    async def broken(model, scenario):
        raise RuntimeError(f"no board for scenario {scenario}")

    panel = TrainingPanel(served, broken, scenarios=[9], group_size=2)
    panel.train_button.click()
    await panel.wait()
    text = "".join(o.get("text", "") for o in panel.output.outputs)
    assert "no board for scenario 9" in text and "max_exceptions" in text
    first_line = text.splitlines()[0]  # the message and hint above the long traceback, not under it
    assert "TooManyExceptions: 1 rollouts failed" in first_line and "Raise max_exceptions" in first_line
    assert (
        "step failed: TooManyExceptions: 1 rollouts failed, more than max_exceptions=0" in panel.status.value
    )
    assert buttons(panel)["train"] and panel.loop.phase == "idle" and panel.loop.pending == []

    panel.loop.rollout = tic_tac_toe.rollout
    panel.gather_button.click()
    await panel.wait()
    assert panel.output.outputs == () and "failed" not in panel.status.value  # the old error is gone
    assert len(panel.loop.pending) == 1


async def test_a_non_finite_reward_is_shown_and_training_refuses_it(served):
    async def nan_reward(model, scenario):
        game = await tic_tac_toe.rollout(model, scenario)
        game.reward = float("nan") if scenario == 0 else game.reward
        return game

    panel = TrainingPanel(served, nan_reward, scenarios=[0], group_size=2)
    start = panel.step
    panel.train_button.click()
    await panel.wait()
    assert (
        "rewards must be finite numbers" in panel.status.value
        and "step failed: ValueError" in panel.status.value
    )
    assert "non-finite reward in trajectory 0 (nan), 1 (nan)" in panel.group_view.summary.value
    assert panel.step == start and len(panel.loop.pending) == 1
