"""OffPolicyPlot: a live plotly FigureWidget of each training step's policy lag and importance-ratio spread.

Pipelined training (`artnb.pipeline_trainer`) trains on rollouts sampled by older policies; this shows how much
older (`train/steps_off_policy`, mean and max) and what it did to the update (`train/ratio_std`). TrainingPanel
shows it under the reward plot. Like RewardPlot, it is live for a model (redrawn after every row the model
records) and redrawn by `refresh()` for a run directory. The figure itself is `artnb.plots.off_policy_figure`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import ipywidgets as widgets
import plotly.graph_objects as go

from ..core.model import Model
from ..core.store import RunStore
from ..plots import off_policy_figure
from .reward_plot import as_store


class OffPolicyPlot(widgets.VBox):
    """Policy lag and ratio spread per step, for a model (live) or a run directory (`refresh()` redraws)."""

    def __init__(self, source: Model | RunStore | str | Path) -> None:
        self.store = as_store(source)
        self.figure = go.FigureWidget()
        self.note = widgets.HTML()
        super().__init__([self.figure, self.note])
        self.add_class("artnb-off-policy-plot")
        self.refresh()
        if isinstance(source, Model):
            source.reporting.on_row(self._on_row)

    def _on_row(self, _: dict[str, Any]) -> None:
        if self.comm is not None:  # not closed
            self.refresh()

    def refresh(self) -> None:
        drawn = off_policy_figure(self.store.history())
        with self.figure.batch_update():
            self.figure.data = []
            self.figure.add_traces(list(drawn.data))
            self.figure.layout = drawn.layout
        self.note.value = (
            "" if drawn.data else "<i>lag and ratio spread appear after the first training step</i>"
        )

    @property
    def metrics(self) -> dict[str, list[float]]:
        """The plotted values per metric (what a test or a user checks after a step)."""
        traces = cast("tuple[Any, ...]", self.figure.data)  # plotly's properties are untyped (read as str)
        return {t.meta["metric"]: list(t.y) for t in traces}
