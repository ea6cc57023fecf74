"""Benchmark charts over `load_trajectories`' table: a metric over training steps, and first-vs-last bars.

Same calls as OpenPipe ART's `art.utils.benchmarking.charts` (`training_progress_chart`,
`percentage_comparison_bar_chart`), and the same reading of the table: a metric is a column (`"reward"`) or a
`metric_<name>` column (`"win_rate"`), averaged per model and step; a model logged at several steps is
"trained" and drawn as a curve, a model logged at one step is a "comparison" (a prompted baseline) and drawn
as a flat line across the trained models' steps.

Departures from ART:
- The table is pandas and the figures are plotly (`plotly.graph_objects.Figure`), not matplotlib/seaborn,
  styled like artnb's other plots (`artnb.plots`): interactive in the notebook, hover for values.
- The figures are a `BenchmarkFigure`, a plotly Figure with `savefig(path)` so ART notebook code such as
  `chart.savefig("win_rate.png")` still runs. PNG/SVG/PDF need the optional `kaleido` package; without it
  `savefig` writes an interactive `.html` beside the requested path and warns.
- A requested model with no rows on its split is left out with a warning (ART's line chart raised KeyError).
- The bar chart labels a decline as "RL -5%" (ART printed "RL +-5%").
- ART set matplotlib's global dpi and seaborn theme as a side effect; nothing global is changed here.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pandas as pd
import plotly.colors
import plotly.graph_objects as go

from ...plots import style_reward_figure
from .filter_model_split import filter_rename_model_split
from .types import BenchmarkModelKey

_PALETTE = plotly.colors.qualitative.D3  # the same blue and orange as artnb.plots' train and val lines
_UNCHANGED = "rgb(214,210,203)"  # bars of models without a first-to-last change (prompted baselines)
_REFERENCE = "dimgray"

# matplotlib legend locations (ART's legend_loc) as plotly legend anchors
_LEGEND_AT = {
    "upper right": (0.99, 0.99, "right", "top"),
    "upper left": (0.01, 0.99, "left", "top"),
    "lower left": (0.01, 0.01, "left", "bottom"),
    "lower right": (0.99, 0.01, "right", "bottom"),
    "right": (0.99, 0.5, "right", "middle"),
    "center left": (0.01, 0.5, "left", "middle"),
    "center right": (0.99, 0.5, "right", "middle"),
    "lower center": (0.5, 0.01, "center", "bottom"),
    "upper center": (0.5, 0.99, "center", "top"),
    "center": (0.5, 0.5, "center", "middle"),
}


class BenchmarkFigure(go.Figure):
    """A plotly Figure that also answers matplotlib's `savefig`, for notebooks written against ART."""

    def savefig(self, fname: str | Path, dpi: float | None = None, **_ignored: object) -> Path:
        """Write the chart to `fname` (.png/.svg/.pdf/.jpg with kaleido installed, or .html); the path written.

        matplotlib-only keywords (`bbox_inches`, ...) are accepted and ignored; `dpi` scales the image.
        """
        path = Path(fname)
        if not path.suffix:
            path = path.with_suffix(".png")  # matplotlib's default format
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix.lower() in (".html", ".htm"):
            self.write_html(path, include_plotlyjs="cdn")
            return path
        try:
            self.write_image(path, scale=(dpi / 100) if dpi else 2)
        except Exception as exc:  # kaleido missing, or it found no Chrome to render with
            fallback = path.with_suffix(".html")
            self.write_html(fallback, include_plotlyjs="cdn")
            warnings.warn(
                f"could not write {path} ({type(exc).__name__}: {exc}); wrote the interactive chart to "
                f"{fallback} instead. For image files: pip install kaleido (it renders with Chrome).",
                stacklevel=2,
            )
            return fallback
        return path


def training_progress_chart(
    df: pd.DataFrame,
    metric_name: str,
    models: list[str | BenchmarkModelKey] | None = None,
    title: str | None = None,
    x_label: str | None = None,
    y_label: str | None = None,
    perfect_score: float | None = None,
    legend_loc: str | None = "lower right",
) -> BenchmarkFigure:
    """Mean `metric_name` per step for each model: trained models as curves, baselines as flat dashed lines.

    `models` picks and orders the models: names (their "val" split) or `BenchmarkModelKey(name, label, split)`;
    None draws every model in `df`, all splits pooled. `legend_loc` takes matplotlib's names ("lower right").

    >>> df = await load_trajectories("codenames-rl", art_path="./.art")
    >>> training_progress_chart(df, "win_rate", models=[BenchmarkModelKey("agent-001", "RL agent")])
    """
    column = _metric_column(df, metric_name)
    table, order = _select(df, models)
    means = _means(table, column)
    trained, baselines = _split_trained(means, order)
    steps = sorted(means["step"].unique().tolist())
    if not steps:
        raise ValueError(f"no {column!r} values for {order}; every selected row has it missing")
    first, last = steps[0], steps[-1]
    colours = {m: _PALETTE[i % len(_PALETTE)] for i, m in enumerate(trained + baselines)}
    rank = {m: i for i, m in enumerate(trained + baselines)}  # legend: trained models first

    fig = BenchmarkFigure()
    drawn_scores: set[float] = set()
    for model in baselines:  # drawn first, so the trained curves sit on top
        score = float(means.loc[means["model"] == model, column].iloc[0])
        dash = "dot" if score in drawn_scores else "dash"  # a second baseline on the same score stays visible
        drawn_scores.add(score)
        fig.add_trace(
            go.Scatter(
                x=[first, last],
                y=[score, score],
                mode="lines",
                name=model,
                line={"color": colours[model], "dash": dash, "width": 2},
                legendrank=rank[model],
                meta={"role": "baseline"},
            )
        )
    for model in trained:
        rows = means[means["model"] == model]
        fig.add_trace(
            go.Scatter(
                x=rows["step"].tolist(),
                y=rows[column].tolist(),
                mode="lines+markers",
                name=model,
                line={"color": colours[model], "width": 2},
                legendrank=rank[model],
                meta={"role": "trained"},
            )
        )
    if perfect_score is not None:
        _perfect_score_line(fig, perfect_score)

    style_reward_figure(fig, y_label or "", title or metric_name, last)
    fig.update_layout(xaxis_title="Step" if x_label is None else x_label, legend=_legend(legend_loc))
    return fig


def percentage_comparison_bar_chart(
    df: pd.DataFrame,
    metric_name: str,
    models: list[str | BenchmarkModelKey] | None = None,
    title: str | None = None,
    y_label: str | None = None,
    perfect_score: float | None = None,
) -> BenchmarkFigure:
    """A bar per model: its mean `metric_name` at its first step, plus a hatched segment for the change by its
    last step (trained models). Values in [0, 1] are shown as percentages.

    `models` as in `training_progress_chart`.
    """
    column = _metric_column(df, metric_name)
    table, order = _select(df, models)
    means = _means(table, column)
    stats = []  # (model, first-step value, change by the last step)
    for model in order:
        values = means.loc[means["model"] == model, column].tolist()
        if values:
            stats.append((model, values[0], values[-1] - values[0] if len(values) > 1 else 0.0))
    if not stats:
        raise ValueError(f"no {column!r} values for {order}; every selected row has it missing")

    scale = 100.0 if max(base + change for _, base, change in stats) <= 1.01 else 1.0
    unit = "%" if scale == 100.0 else ""
    names = [m for m, _, _ in stats]
    changed = [(m, b * scale, c * scale) for m, b, c in stats if c != 0]
    trained_colour = _PALETTE[1]

    fig = BenchmarkFigure()
    fig.add_trace(
        go.Bar(
            x=names,
            y=[b * scale for _, b, _ in stats],
            name="first step",
            marker={"color": [trained_colour if c != 0 else _UNCHANGED for _, _, c in stats]},
            hovertemplate="%{x}: %{y:.1f}" + unit + " at its first step<extra></extra>",
        )
    )
    if changed:
        fig.add_trace(
            go.Bar(
                x=[m for m, _, _ in changed],
                y=[c for _, _, c in changed],
                base=[b for _, b, _ in changed],
                name="change by last step",
                marker={
                    "color": trained_colour,
                    "pattern": {"shape": "/", "fgcolor": "white"},
                    "opacity": 0.95,
                },
                text=[f"RL {c:+.0f}{unit}" for _, _, c in changed],
                textposition="inside",
                insidetextanchor="middle",
                hovertemplate="%{x}: %{text}<extra></extra>",
            )
        )
    for model, base, change in stats:
        total = (base + change) * scale
        fig.add_annotation(
            x=model, y=total, text=f"<b>{total:.0f}{unit}</b>", showarrow=False, yanchor="bottom"
        )
    if perfect_score is not None:
        _perfect_score_line(fig, perfect_score * scale)

    fig.update_layout(
        title=title or metric_name,
        barmode="overlay",
        showlegend=False,
        template="plotly_white",
        height=380,
        yaxis_title=y_label or "",
    )
    fig.update_yaxes(showticklabels=False, showgrid=False, zeroline=False)
    return fig


def _metric_column(df: pd.DataFrame, metric_name: str) -> str:
    column = metric_name if metric_name in df.columns else f"metric_{metric_name}"
    if column not in df.columns:
        available = ["reward"] + [c.removeprefix("metric_") for c in df.columns if c.startswith("metric_")]
        raise ValueError(
            f"no metric {metric_name!r} in the table (looked for columns {metric_name!r} and {column!r}); "
            f"metrics available: {available}. Metrics come from each trajectory's `metrics` dict."
        )
    return column


def _select(df: pd.DataFrame, models: list[str | BenchmarkModelKey] | None) -> tuple[pd.DataFrame, list[str]]:
    """The rows to draw and the models in drawing order (requested order, or trained then baselines by name)."""
    if models is None:
        if df.empty:
            raise ValueError("the table is empty: load_trajectories found nothing logged (see its warning)")
        step_counts = {str(m): n for m, n in df.groupby("model")["step"].nunique().items()}
        trained = sorted(m for m, n in step_counts.items() if n > 1)
        return df, trained + sorted(m for m, n in step_counts.items() if n <= 1)

    keys = [m if isinstance(m, BenchmarkModelKey) else BenchmarkModelKey(m) for m in models]
    table = filter_rename_model_split(df, keys)
    present = set(table["model"])
    missing = [k for k in keys if str(k) not in present]  # str(k): its display name
    if missing and len(missing) == len(keys):
        logged = sorted(
            (str(m), str(s)) for m, s in df[["model", "split"]].drop_duplicates().itertuples(index=False)
        )
        raise ValueError(
            f"no rows for any of {[(k.name, k.split) for k in keys]} (model, split). The table has {logged}; "
            "a model name alone means its 'val' split: pass BenchmarkModelKey(name, split='train') for others"
        )
    if missing:
        warnings.warn(
            f"left out of the chart, no rows logged: {[(k.name, k.split) for k in missing]} (model, split)",
            stacklevel=3,
        )
    return table, [str(k) for k in keys if str(k) in present]


def _means(table: pd.DataFrame, column: str) -> pd.DataFrame:
    """Mean of `column` per model and step, sorted by step; steps with no value are dropped."""
    # [[column]]: the same table as [column] here, and pandas-stubs type it as a DataFrame
    means = table.groupby(["model", "step"], as_index=False)[[column]].mean()
    return means.dropna(subset=[column]).sort_values(["model", "step"], ignore_index=True)


def _split_trained(means: pd.DataFrame, order: list[str]) -> tuple[list[str], list[str]]:
    counts = means.groupby("model")["step"].nunique().to_dict()
    trained = [m for m in order if counts.get(m, 0) > 1]
    return trained, [m for m in order if counts.get(m, 0) == 1]


def _perfect_score_line(fig: go.Figure, y: float) -> None:
    fig.add_hline(
        y=y,
        line={"color": _REFERENCE, "width": 1},
        annotation_text="Perfect score",
        annotation_position="bottom left",
        annotation_font_color=_REFERENCE,
    )


def _legend(loc: str | None) -> dict:
    if loc is None or loc == "best":
        return {}
    if loc not in _LEGEND_AT:
        raise ValueError(
            f"legend_loc={loc!r} is not one of {['best', *_LEGEND_AT]} (matplotlib's names) or None"
        )
    x, y, xanchor, yanchor = _LEGEND_AT[loc]
    return {"x": x, "y": y, "xanchor": xanchor, "yanchor": yanchor, "bgcolor": "rgba(255,255,255,0.8)"}
