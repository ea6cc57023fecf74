"""PreflightView state without a browser, over a real preflight of tic-tac-toe on the tiny served model."""

import artnb as art
from artnb.tasks import tic_tac_toe
from artnb.widgets import PreflightView


async def test_preflight_of_real_games_and_its_panel(served):
    report = await art.preflight(served, tic_tac_toe.rollout, [3, 4], group_size=3)
    names = [c.name for c in report.checks]
    assert names[:3] == ["rollouts that finished", "rewards are finite numbers", "trainable turns"]
    assert {c.name: c for c in report.checks}["rollouts that finished"].finding == "6 of 6"
    assert [len(g) for g in report.groups] == [3, 3]
    assert all(t.trainable_turns() >= 1 for g in report.groups for t in g)
    view = PreflightView(report)
    assert report.verdict in view.verdict.value
    for check in report.checks:
        assert check.name in view.checks.value and f"artnb-{check.status}" in view.checks.value
    # the batch trains as a step would
    result = await served.train(report.groups, config=art.TrainConfig(learning_rate=1e-3))
    assert result.step == await served.get_step()
