"""Plotly figures over a run's history, shared by the HTML report and the notebook widgets."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

_BAND = {"train": "rgba(31,119,180,0.2)", "val": "rgba(255,127,14,0.2)"}
_LINE = {"train": "rgb(31,119,180)", "val": "rgb(255,127,14)"}


def reward_figure(history: pd.DataFrame, metric: str = "reward", title: str | None = None) -> go.Figure:
    """Mean `metric` per step for each split, with a band of +/- the mean within-group reward std for rewards."""
    fig = go.Figure()
    for split in sorted(history["split"].dropna().unique()) if "split" in history else []:
        col = f"{split}/{metric}"
        if col not in history:
            continue
        rows = history[history["split"] == split].dropna(subset=[col]).groupby("step").mean(numeric_only=True)
        if rows.empty:
            continue
        x, y = rows.index.tolist(), rows[col].tolist()
        spread = f"{split}/reward_std_dev"
        if metric == "reward" and spread in rows:
            s = rows[spread].fillna(0).tolist()
            fig.add_trace(
                go.Scatter(
                    x=x + x[::-1],
                    y=[a + b for a, b in zip(y, s)] + [a - b for a, b in zip(y[::-1], s[::-1])],
                    fill="toself",
                    fillcolor=_BAND.get(split, "rgba(128,128,128,0.2)"),
                    line={"width": 0},
                    hoverinfo="skip",
                    name=f"{split} ± std within group",
                )
            )
        fig.add_trace(
            go.Scatter(x=x, y=y, mode="lines+markers", name=f"{split}/{metric}", line={"color": _LINE.get(split)})
        )
    fig.update_layout(
        title=title or metric,
        xaxis_title="step (policy that produced the rollouts)",
        yaxis_title=metric,
        template="plotly_white",
        height=380,
    )
    return fig
