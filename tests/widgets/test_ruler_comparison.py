"""RulerComparison state: table rows, highlighted disagreements, rank correlation, re-score and its cache."""

import math

import pytest

import artnb as art
from artnb.widgets import RulerComparison


def judged(rewards: list[float], scores: list[float]) -> art.TrajectoryGroup:
    """A group as `ruler_score_group` leaves it: reward = RULER score, the rollout's reward kept in metrics."""
    return art.TrajectoryGroup(
        [
            art.Trajectory(
                messages_and_choices=[{"role": "user", "content": "x" * (i + 1)}],
                reward=s,
                metrics={"independent_reward": r, "ruler_score": s},
                metadata={"ruler_explanation": f"attempt {i} <is> fine"},
            )
            for i, (r, s) in enumerate(zip(rewards, scores, strict=True))
        ]
    )


class LengthJudge:
    """A scorer with `ruler_score_group`'s contract that prefers short or long answers, as the rubric says."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    async def __call__(self, group: art.TrajectoryGroup, judge: str, *, rubric: str) -> art.TrajectoryGroup:
        self.calls.append((judge, rubric))
        out = group.model_copy(deep=True)
        n = max(len(t.messages()[0]["content"]) for t in out)
        for t in out:
            size = len(t.messages()[0]["content"]) / n
            score = 1 - size if "short" in rubric else size
            t.metrics["independent_reward"] = t.metrics.get("independent_reward", t.reward)
            t.metrics["ruler_score"] = score
            t.metadata["ruler_explanation"] = f"{judge}: length {size:.2f}"
            t.reward = score
        return out


def test_table_highlights_disagreements_and_reports_rank_correlation():
    agree = judged([0.0, 0.5, 1.0, 0.2], [0.1, 0.6, 0.9, 0.3])
    flip = judged([0.0, 0.5, 1.0, 0.2], [0.9, 0.4, 0.0, 0.3])  # best and worst swapped
    view = RulerComparison([agree, flip], judge="openai/o4-mini")
    t, g = view.comparison.trajectories, view.comparison.groups
    assert len(t) == 8 and list(g["spearman"]) == [1.0, pytest.approx(-0.8)]
    flagged = view.disagreements
    assert set(flagged["group"]) == {1} and list(flagged["trajectory"]) == [0, 2]  # rank gap 3 (>= 4/4)
    assert view.table.value.count("class='artnb-disagree'") == 2
    assert "attempt 0 &lt;is&gt; fine" in view.table.value
    assert "2 of 8 trajectories ranked in opposite order" in view.status.value
    assert "-0.8" in view.groups_table.value
    assert view.group_select.label == "group 0"  # the chart's group is shown, not an empty dropdown
    ruler_bars = view.chart.data[1]
    assert list(view.chart.data[0].y) == [0.0, 0.5, 1.0, 0.2] and list(ruler_bars.y) == [0.1, 0.6, 0.9, 0.3]
    view.group_select.value = 1
    assert list(view.chart.data[1].marker.line.width) == [2, 0, 2, 0]
    assert RulerComparison(flip, min_rank_gap=4).disagreements.empty
    all_tied = RulerComparison(judged([0.0, 0.5, 1.0, 0.2], [1.0, 1.0, 1.0, 1.0]))
    assert all_tied.disagreements.empty and math.isnan(all_tied.comparison.groups["spearman"][0])


async def test_rescore_with_an_edited_rubric_updates_and_caches():
    group = art.TrajectoryGroup(
        [
            art.Trajectory(messages_and_choices=[{"role": "user", "content": "x" * n}], reward=r)
            for n, r in [(1, 1.0), (2, 0.5), (4, 0.0)]
        ]
    )
    judge = LengthJudge()
    view = RulerComparison(
        group, judge="local-judge", judges=["other-judge"], rubric="prefer long", score=judge
    )
    assert view.comparison.trajectories["ruler_score"].isna().all()
    assert "not judged yet" in view.status.value and list(view.judge.options) == [
        "local-judge",
        "other-judge",
    ]

    view.rescore_button.click()
    assert view.rescore_button.disabled
    await view.wait()
    assert not view.rescore_button.disabled
    t = view.comparison.trajectories
    assert list(t["ruler_score"]) == [0.25, 0.5, 1.0] and list(t["independent_reward"]) == [1.0, 0.5, 0.0]
    assert view.comparison.groups["spearman"][0] == -1.0 and len(view.disagreements) == 2
    assert "scored by local-judge" in view.status.value and "local-judge: length 0.25" in view.table.value

    view.rubric.value = "prefer short"
    await view.rescore()
    assert list(view.comparison.trajectories["ruler_score"]) == [0.75, 0.5, 0.0]
    assert view.comparison.groups["spearman"][0] == 1.0 and view.disagreements.empty
    assert view.source_groups[0] is group and group[0].reward == 1.0  # re-scoring starts from the originals

    view.rubric.value = "prefer long"
    await view.rescore()  # cached: no judge call
    assert len(judge.calls) == 2 and list(view.comparison.trajectories["ruler_score"]) == [0.25, 0.5, 1.0]
    view.judge.value = "other-judge"
    await view.rescore()
    assert judge.calls[-1] == ("other-judge", "prefer long")


async def test_a_failing_judge_shows_the_error_in_the_panel():
    async def broken(group, judge, *, rubric):
        raise ValueError("judge unreachable: set OPENAI_API_KEY")

    view = RulerComparison(judged([0.0, 1.0], [0.0, 1.0]), judge="x", score=broken)
    view.rescore_button.click()
    await view.wait()
    assert "re-score failed" in view.status.value and not view.rescore_button.disabled
    assert "judge unreachable" in view.output.outputs[-1]["text"]
    view.judge.value = " "
    view.rescore_button.click()
    await view.wait()
    assert "choose a judge" in view.output.outputs[-1]["text"]


async def test_default_scorer_judges_with_a_served_model(served, played_group, tmp_path, monkeypatch):
    """The real `art.ruler_score_group` with the served tiny model as the judge (schema-constrained JSON)."""
    monkeypatch.setenv("ARTNB_CACHE_DIR", str(tmp_path))
    view = RulerComparison(played_group, judge=served, rubric="Legal moves are better.")
    await view.rescore()
    t = view.comparison.trajectories
    assert t["ruler_score"].between(0, 1).all() and len(t) == 4
    assert list(t["independent_reward"]) == played_group.rewards()
    assert all(isinstance(e, str) for e in t["explanation"]) and not math.isnan(t["ruler_score"].sum())
