"""Plotly figures over a run's history, shared by the HTML report and the notebook widgets.

The numbers come from `core.curves` (mean per split and step, a band for the spread); this module only turns
them into traces, so the static report and the live `RewardPlot` widget draw the same thing.
"""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd
import plotly.graph_objects as go

from .core.curves import Band, Curve, curves
from .core.metric_names import split_metric

_BAND = {"train": "rgba(31,119,180,0.2)", "val": "rgba(255,127,14,0.2)"}
_LINE = {"train": "rgb(31,119,180)", "val": "rgb(255,127,14)"}


def curve_traces(items: list[Curve]) -> list[go.Scatter]:
    """A filled band trace (when the curve has one) and a line trace per curve."""
    traces = []
    for c in items:
        if c.lower is not None and c.upper is not None:
            traces.append(
                go.Scatter(
                    x=c.steps + c.steps[::-1],
                    y=c.upper + c.lower[::-1],
                    fill="toself",
                    mode="lines",
                    fillcolor=_BAND.get(c.split, "rgba(128,128,128,0.2)"),
                    line={"width": 0},
                    hoverinfo="skip",
                    name=f"{c.split} {c.band_label}",
                    meta={"role": "band", "split": c.split},
                )
            )
        traces.append(
            go.Scatter(
                x=c.steps,
                y=c.mean,
                mode="lines+markers",
                name=f"{c.split}/{c.metric}",
                line={"color": _LINE.get(c.split)},
                meta={"role": "mean", "split": c.split},
            )
        )
    return traces


def style_reward_figure(
    fig: go.Figure | go.FigureWidget, metric: str, title: str | None = None, last_step: int = 0
) -> None:
    """Titles and axes; steps are whole numbers, so a short run gets one tick per step."""
    fig.update_layout(
        title=title or metric,
        xaxis_title="step (policy that produced the rollouts)",
        yaxis_title=metric,
        template="plotly_white",
        height=380,
    )
    step_axis(fig, last_step)


def step_axis(fig: go.Figure | go.FigureWidget, last_step: int) -> None:
    """Steps are whole numbers: one tick per step for a short run (plotly would add halves, and `tickformat="d"`
    would print them as repeated integers), plotly's own spacing (whole numbers at that range) for a long one."""
    fig.update_xaxes(dtick=1 if last_step <= 20 else None, tick0=0, tickformat="d")


def reward_figure(
    history: pd.DataFrame,
    metric: str = "reward",
    title: str | None = None,
    band: Band = "std",
    values: Callable[[str], pd.DataFrame] | None = None,
) -> go.Figure:
    """Mean `metric` per step for each split, with a band for the spread (see `core.curves`)."""
    items = curves(history, metric, band, values)
    fig = go.Figure(curve_traces(items))
    style_reward_figure(fig, metric, title, max((c.steps[-1] for c in items), default=0))
    return fig


def evaluation_figure(
    table: pd.DataFrame, metrics: tuple[str, ...] = ("reward",), confidence: float = 0.95
) -> go.Figure:
    """Bars of each metric's mean per model with its bootstrap interval as error bars (`core.evaluate` table;
    a `run` column makes the interval cover the runs too)."""
    from .core.evaluate import summarize_evaluation

    summary = summarize_evaluation(table, metrics, confidence=confidence)
    bars = []
    for metric in metrics:
        mean, low, high = (summary[(metric, c)] for c in ("mean", "low", "high"))
        bars.append(
            go.Bar(
                name=metric,
                x=list(summary.index),
                y=mean.tolist(),
                error_y={
                    "type": "data",
                    "symmetric": False,
                    "array": (high - mean).clip(lower=0).fillna(0).tolist(),
                    "arrayminus": (mean - low).clip(lower=0).fillna(0).tolist(),
                },
                hovertext=[
                    f"{m:.3f} [{lo:.3f}, {hi:.3f}], {int(n)} games"
                    for m, lo, hi, n in zip(mean, low, high, summary[(metric, "count")], strict=True)
                ],
            )
        )
    fig = go.Figure(bars)
    fig.update_layout(
        title=f"evaluation: same scenarios, each model (bars: {confidence:.0%} interval)",
        barmode="group",
        template="plotly_white",
        height=380,
    )
    return fig


def runs_figure(
    runs: dict[str, tuple[pd.DataFrame, str]], split: str = "train", title: str = ""
) -> go.Figure:
    """One line per run: `{label: (history, metric)}`, the mean of `split/metric` per step.

    For comparing runs that were rewarded differently on the same yardstick, e.g. the game's own reward,
    which a RULER-trained run keeps as `independent_reward`.
    """
    fig = go.Figure()
    for label, (history, metric) in runs.items():
        column = split_metric(split, metric)
        if column not in history.columns:
            raise KeyError(
                f"run {label!r} has no {column!r} in its history; it has {sorted(history.columns)}"
            )
        rows = history[history["split"] == split].groupby("step")[column].mean().dropna()
        fig.add_trace(go.Scatter(x=rows.index.tolist(), y=rows.tolist(), mode="lines+markers", name=label))
    fig.update_layout(
        title=title or f"{split}: runs compared",
        xaxis_title="step (policy that produced the rollouts)",
        template="plotly_white",
        height=380,
    )
    return fig


OFF_POLICY = {  # metric -> (label, axis): lag in steps on the left axis, the ratio's spread on the right
    "train/steps_off_policy": ("policy lag, mean (steps)", "y"),
    "train/steps_off_policy_max": ("policy lag, max (steps)", "y"),
    "train/ratio_std": ("importance ratio spread (std)", "y2"),
}


def off_policy_figure(history: pd.DataFrame, title: str = "how off-policy each step trained") -> go.Figure:
    """Per training step: how many steps behind the trained policy its rollouts' policies were, and the spread of
    the importance ratios new/sampling policy (which that lag widens; large spreads mean clipped, noisy
    updates). Steps without a value (a synchronous loop records no lag) are left out of that line."""
    rows = history[history["split"] == "train"] if "split" in history.columns else history.iloc[:0]
    fig = go.Figure()
    last_step = 0
    for column, (label, axis) in OFF_POLICY.items():
        if column not in rows.columns:
            continue
        values = rows.groupby("step")[column].max().dropna()
        if values.empty:
            continue
        last_step = max(last_step, int(values.index.max()))
        fig.add_trace(
            go.Scatter(
                x=values.index.tolist(),
                y=values.tolist(),
                mode="lines+markers",
                name=label,
                yaxis=axis,
                line={"dash": "dot"} if column.endswith("_max") else {},
                meta={"metric": column},
            )
        )
    fig.update_layout(
        title=title,
        xaxis_title="step (trained)",
        yaxis={"title": "steps behind", "rangemode": "tozero"},
        yaxis2={"title": "ratio std", "overlaying": "y", "side": "right", "rangemode": "tozero"},
        template="plotly_white",
        height=300,
        legend={"orientation": "h", "y": -0.25},
    )
    step_axis(fig, last_step)
    return fig
