"""RulerComparison: your reward beside RULER's score, per trajectory and per group, with a re-score loop.

Interactive reward debugging: the table and bar chart show where the hand-written reward and the judge rank
trajectories differently (rows highlighted), with the judge's explanation; the group table gives the rank
correlation. Edit the rubric or pick another judge and press re-score to see the scores change.

Why it is built this way:
- The numbers are `core.compare.compare_rewards`; this widget only lays them out.
- Re-scoring always starts from the groups it was given (`ruler_score_group` keeps the first independent
  reward), never from a previous re-score, so scores never drift across edits.
- Results are cached per (judge, rubric, group), in memory here and on disk by `ruler_score_group`, so going
  back to an earlier rubric is instant and costs no judge calls.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import ipywidgets as widgets
import pandas as pd
import plotly.graph_objects as go

from ..core.compare import RewardComparison, compare_rewards
from ..core.contracts import InProcessJudge
from ..core.model import Model
from ..core.trajectory import TrajectoryGroup
from .background import Background
from .render import STYLE, table_html

Judge = str | Model | InProcessJudge
GroupScorer = Callable[..., Awaitable[TrajectoryGroup | None]]


def default_scorer(extra_litellm_params: dict[str, Any] | None = None) -> GroupScorer:
    """`art.ruler_score_group` with the given litellm parameters (imported when first used)."""

    async def score(group: TrajectoryGroup, judge: Judge, *, rubric: str) -> TrajectoryGroup | None:
        from ..core.ruler import ruler_score_group

        return await ruler_score_group(group, judge, extra_litellm_params, rubric)

    return score


class RulerComparison(widgets.VBox):
    """Independent reward vs RULER score per trajectory (table, bar chart), rank correlation per group.

    Example:
        scored = [await art.ruler_score_group(g, judge) for g in groups]
        art.widgets.RulerComparison(scored, judge=judge)           # already judged: shows the comparison
        art.widgets.RulerComparison(groups, judge=judge)           # not judged yet: press re-score

    judge: a litellm model string ("openai/o4-mini") or an `art.Model` (e.g. a locally served model).
    judges: more choices for the judge box, a list or a {label: judge} mapping; any litellm string can be typed.
    score: `async score(group, judge, *, rubric) -> group`; default `art.ruler_score_group`.
    min_rank_gap: highlight a row when the rewards order it oppositely to another trajectory and its two
        ranks differ by at least this; default a quarter of the group size (at least 1).
    """

    def __init__(
        self,
        groups: TrajectoryGroup | Sequence[TrajectoryGroup],
        *,
        judge: Judge | None = None,
        judges: Sequence[Judge] | Mapping[str, Judge] = (),
        rubric: str | None = None,
        score: GroupScorer | None = None,
        extra_litellm_params: dict[str, Any] | None = None,
        min_rank_gap: float | None = None,
    ) -> None:
        from ..core.ruler import DEFAULT_RUBRIC

        self.source_groups = [groups] if isinstance(groups, TrajectoryGroup) else list(groups)
        if not self.source_groups or not all(isinstance(g, TrajectoryGroup) for g in self.source_groups):
            raise TypeError("RulerComparison takes an art.TrajectoryGroup or a non-empty list of them")
        self.groups = self.source_groups
        self.scorer = score or default_scorer(extra_litellm_params)
        self.min_rank_gap = min_rank_gap
        self.cache: dict[tuple[str, str, int], TrajectoryGroup] = {}
        self.judge_choices = _judge_choices(judge, judges)
        self.comparison: RewardComparison = compare_rewards(self.groups)

        self.rubric = widgets.Textarea(
            value=rubric if rubric is not None else DEFAULT_RUBRIC,
            description="rubric",
            layout=widgets.Layout(width="100%", height="8em"),
        )
        self.judge = widgets.Combobox(
            options=list(self.judge_choices),
            value=next(iter(self.judge_choices), ""),
            placeholder="litellm model, e.g. openai/o4-mini",
            description="judge",
            ensure_option=False,
            layout=widgets.Layout(width="360px"),
        )
        self.rescore_button = widgets.Button(description="re-score", icon="refresh", button_style="primary")
        self.status = widgets.HTML()
        self.output = widgets.Output(layout={"max_height": "160px", "overflow": "auto"})
        self.background = Background(self.output)
        self.group_select = widgets.Dropdown(description="chart", layout=widgets.Layout(width="auto"))
        self.chart = go.FigureWidget()
        self.groups_table = widgets.HTML()
        self.table = widgets.HTML()
        self.rescore_button.on_click(lambda _: self._start_rescore())
        self.group_select.observe(lambda _: self._draw_chart(), names="value")
        controls = widgets.VBox([self.rubric, widgets.HBox([self.judge, self.rescore_button]), self.status])
        super().__init__(
            [
                widgets.HTML(STYLE),
                controls,
                self.output,
                self.groups_table,
                self.group_select,
                self.chart,
                self.table,
            ]
        )
        self.add_class("artnb-ruler-comparison")
        self._render()

    # state --------------------------------------------------------------------------------------------
    @property
    def selected_judge(self) -> Judge:
        text = self.judge.value.strip()
        if not text:
            raise ValueError("choose a judge: type a litellm model name (e.g. openai/o4-mini) or pick one")
        return self.judge_choices.get(text, text)

    def gap_threshold(self, size: int) -> float:
        return self.min_rank_gap if self.min_rank_gap is not None else max(1.0, size / 4)

    @property
    def disagreements(self) -> pd.DataFrame:
        """The highlighted rows: the two rewards order this trajectory and another one oppositely, and its
        ranks differ by at least the threshold. Ties on one side (a judge giving equal scores) are no
        disagreement, only less resolution."""
        t = self.comparison.trajectories
        if t.empty:
            return t
        flagged = []
        for _, rows in t.dropna(subset=["ruler_score"]).groupby("group"):
            ind = rows["independent_reward"].to_numpy()
            rul = rows["ruler_score"].to_numpy()
            opposite = ((ind[:, None] - ind[None, :]) * (rul[:, None] - rul[None, :]) < 0).any(axis=1)
            large = rows["disagreement"].to_numpy() >= self.gap_threshold(len(rows))
            flagged.extend(rows.index[opposite & large])
        return t.loc[sorted(flagged)]

    # actions ------------------------------------------------------------------------------------------
    async def rescore(self) -> RewardComparison:
        """Score the original groups with the current judge and rubric (cached), then redraw."""
        judge, rubric = self.selected_judge, self.rubric.value
        key = _judge_key(judge)
        scored = []
        for gi, group in enumerate(self.source_groups):
            cached = self.cache.get((key, rubric, gi))
            if cached is None:
                self.status.value = f"scoring group {gi + 1}/{len(self.source_groups)} with {key}…"
                out = self.scorer(group, judge, rubric=rubric)
                cached = await out if inspect.isawaitable(out) else out
                if cached is None:
                    raise RuntimeError(
                        f"the scorer returned None for group {gi} (a swallowed judge error); see the warning "
                        "in the log, or score with swallow_exceptions=False to get the error"
                    )
                self.cache[(key, rubric, gi)] = cached
            scored.append(cached)
        self.groups = scored
        self.comparison = compare_rewards(scored)
        self._render(note=f"scored by {key}")
        return self.comparison

    async def wait(self) -> None:
        await self.background.wait()

    def _start_rescore(self) -> None:
        self.rescore_button.disabled = True

        async def run() -> None:
            try:
                await self.rescore()
            except Exception:
                self.status.value = "<b>re-score failed</b>: see the error below"
                raise
            finally:
                self.rescore_button.disabled = False

        self.background.start(run())

    # view ---------------------------------------------------------------------------------------------
    def _render(self, note: str = "") -> None:
        t, g = self.comparison.trajectories, self.comparison.groups
        judged = t["ruler_score"].notna().any() if not t.empty else False
        self.groups_table.value = "<b>per group</b>" + table_html(
            ["group", "size", "Spearman (reward vs RULER ranks)", "mean reward", "mean RULER"],
            g[["group", "size", "spearman", "mean_independent", "mean_ruler"]].itertuples(index=False),
        )
        flagged = set(self.disagreements.index)
        self.table.value = (
            "<b>per trajectory</b> (highlighted: reward and RULER order it oppositely to another one)"
            + table_html(
                [
                    "group",
                    "trajectory",
                    "reward",
                    "RULER",
                    "reward rank",
                    "RULER rank",
                    "rank gap",
                    "explanation",
                ],
                (
                    [
                        r.group,
                        r.trajectory,
                        r.independent_reward,
                        r.ruler_score,
                        r.independent_rank,
                        r.ruler_rank,
                        r.disagreement,
                        r.explanation,
                    ]
                    for r in t.itertuples()
                ),
                ["artnb-disagree" if i in flagged else "" for i in t.index],
            )
        )
        options = [(f"group {i}", i) for i in range(len(self.groups))]
        if list(self.group_select.options) != options:
            self.group_select.options = options
        if options and self.group_select.index is None:  # ipywidgets leaves a new option list unselected
            self.group_select.index = 0
        self.group_select.layout.display = None if len(options) > 1 else "none"
        status = note or ("" if judged else "not judged yet: pick a judge and press re-score")
        if judged:
            status += (
                f"{' · ' if status else ''}{len(flagged)} of {len(t)} trajectories ranked in opposite order"
            )
        self.status.value = status
        self._draw_chart()

    def _draw_chart(self) -> None:
        gi = self.group_select.value or 0
        t = self.comparison.trajectories
        rows = t[t["group"] == gi] if not t.empty else t
        x = [f"t{i}" for i in rows["trajectory"]] if not rows.empty else []
        flagged = set(self.disagreements.index)
        outline = [2 if i in flagged else 0 for i in rows.index]
        with self.chart.batch_update():
            self.chart.data = []
            self.chart.add_bar(x=x, y=list(rows["independent_reward"]), name="your reward")
            self.chart.add_bar(
                x=x,
                y=[None if math.isnan(v) else v for v in rows["ruler_score"]],
                name="RULER score",
                marker={"line": {"width": outline, "color": "rgb(214,39,40)"}},
            )
            self.chart.update_layout(
                barmode="group",
                title=f"group {gi}: reward and RULER score per trajectory (red outline: ranks disagree)",
                template="plotly_white",
                height=320,
                margin={"t": 40, "b": 30},
            )


def _judge_choices(judge: Judge | None, judges: Sequence[Judge] | Mapping[str, Judge]) -> dict[str, Judge]:
    items = list(judges.items()) if isinstance(judges, Mapping) else [(_judge_key(j), j) for j in judges]
    if judge is not None:
        items.insert(0, (_judge_key(judge), judge))
    return dict(items)


def _judge_key(judge: Judge) -> str:
    if isinstance(judge, Model):
        return f"{judge.name} (art.Model)"
    if isinstance(judge, str):
        return judge
    if isinstance(judge, InProcessJudge):
        return f"{judge.label}, offline"
    raise TypeError(
        f"a judge is a litellm model string, an art.Model or an art.LocalJudge, got {type(judge).__name__}"
    )
