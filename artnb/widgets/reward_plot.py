"""RewardPlot: a plotly FigureWidget of a metric per step, mean line and spread band per split.

It reads the history the backend writes (`history.jsonl`) and the logged trajectories for the band, so the
same widget shows a running loop and a finished run read from disk (`RewardPlot("./.art/project/models/name")`).
Given a model, it is live: it listens for every history row the model records (`model.reporting.on_row`: train
steps, `model.log`) and redraws, held weakly so a plot that is gone costs training nothing. Given a run
directory, a RunStore or a DataFrame, it redraws on `refresh()` (another process may be writing that run).
The numbers come from `core.curves`, the traces from `artnb.plots`, which the static HTML report uses too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import ipywidgets as widgets
import pandas as pd
import plotly.graph_objects as go

from ..core.curves import Band, curves, metric_names, trajectory_values
from ..core.model import Model
from ..core.store import RunStore
from ..plots import curve_traces, style_reward_figure

BANDS = {"± std": "std", "min–max": "range", "none": "none"}


def as_store(source: Model | RunStore | str | Path) -> RunStore:
    """A model, a RunStore, or a model's run directory (`{path}/{project}/models/{name}`) as a RunStore."""
    if isinstance(source, RunStore):
        return source
    if isinstance(source, Model):
        return source.store
    if isinstance(source, (str, Path)):
        return RunStore.from_dir(source)
    raise TypeError(
        f"RewardPlot takes a model, a RunStore, a run directory or a history DataFrame, got {type(source).__name__}"
    )


class RewardPlot(widgets.VBox):
    """Mean of a metric per step with a band for its spread; one line per split (train, val, ...).

    Example:
        plot = art.widgets.RewardPlot(model)            # live: a point appears as each step is recorded
        art.widgets.RewardPlot(run_dir)                 # or RewardPlot(model.store): plot.refresh() re-reads it
    """

    def __init__(
        self,
        source: Model | RunStore | str | Path | pd.DataFrame,
        metric: str = "reward",
        band: str = "std",
        title: str | None = None,
    ) -> None:
        if band not in BANDS.values():
            raise ValueError(f"band={band!r}: choose one of {list(BANDS.values())}")
        self._history_frame = source if isinstance(source, pd.DataFrame) else None
        self.store = None if isinstance(source, pd.DataFrame) else as_store(source)
        self.live = isinstance(source, Model)  # redraws by itself as the model records rows
        self.title = title
        self.figure = go.FigureWidget()
        style_reward_figure(self.figure, metric, title)
        self.metric = widgets.Dropdown(options=[metric], value=metric, description="metric")
        self.band = widgets.Dropdown(
            options=list(BANDS.items()), value=band, description="band", layout={"width": "200px"}
        )
        self.note = widgets.HTML()
        self._refreshing = False
        self.metric.observe(self._on_choice, names="value")
        self.band.observe(self._on_choice, names="value")
        super().__init__([widgets.HBox([self.metric, self.band]), self.figure, self.note])
        self.add_class("artnb-reward-plot")
        self.refresh()
        if isinstance(source, Model):
            source.reporting.on_row(self._on_row)

    def _on_row(self, _: dict[str, Any]) -> None:
        if self.comm is not None:  # not closed
            self.refresh()

    def _on_choice(self, _: object) -> None:
        if not self._refreshing:
            self.refresh()

    def history(self) -> pd.DataFrame:
        if self._history_frame is not None:
            return self._history_frame
        assert self.store is not None  # __init__ sets one of the two
        return self.store.history()

    def refresh(self, history: pd.DataFrame | None = None) -> None:
        """Re-read the history (or take the one given) and redraw; new steps appear as new points."""
        history = self.history() if history is None else history
        names = metric_names(history)
        # ipywidgets types a Dropdown's value as Any | None; these always hold one of their options
        metric = cast(str, self.metric.value)
        band = cast(Band, self.band.value)
        if metric not in names:
            names = [metric, *names]
        if list(self.metric.options) != names:
            self._refreshing = True
            try:
                self.metric.options = names
                self.metric.value = metric
            finally:
                self._refreshing = False
        store = self.store
        values = None if store is None else (lambda split: trajectory_values(store, split))
        items = curves(history, metric, band, values)
        with self.figure.batch_update():
            self.figure.data = []
            self.figure.add_traces(curve_traces(items))
            style_reward_figure(self.figure, metric, self.title, max((c.steps[-1] for c in items), default=0))
        later = "points appear as the model records steps" if self.live else "refresh() redraws"
        self.note.value = "" if items else f"<i>no {metric!r} logged yet; {later}</i>"

    @property
    def points(self) -> dict[str, int]:
        """Number of plotted steps per split (what a test or a user checks after a step)."""
        traces = cast("tuple[Any, ...]", self.figure.data)  # plotly's properties are untyped (read as str)
        return {t.meta["split"]: len(t.x) for t in traces if (t.meta or {}).get("role") == "mean"}
