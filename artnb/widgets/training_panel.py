"""TrainingPanel: buttons over `core.loop.TrainingLoop`, with live progress, a RewardPlot, an OffPolicyPlot (policy
lag and importance-ratio spread per step) and a GroupView.

The panel decides nothing: buttons call the loop's phases as background tasks (`widgets.background`), and
the loop's events move the bars, the labels and the button states. So the kernel stays free while a step
runs (a cell can read `panel.loop.pending` meanwhile), Stop means what the loop says (finish the current
phase, then stop), and everything the panel shows is tested through the loop's own events.
"""

from __future__ import annotations

import contextlib
import html
from collections.abc import Coroutine
from typing import Any

import ipywidgets as widgets

from ..core import metric_names as names
from ..core.config import TrainConfig
from ..core.loop import LoopEvent, Rollout, Scenarios, Scorer, TrainingLoop
from ..core.model import TrainableModel
from .background import Background
from .group_view import GroupView
from .off_policy_plot import OffPolicyPlot
from .reward_plot import RewardPlot

PHASE_TEXT = {"idle": "idle", "gather": "gathering rollouts", "score": "scoring groups", "train": "training"}


class TrainingPanel(widgets.VBox):
    """Gather, Score, Train step, Run N steps and Stop for a registered model, with live plots.

    Example:
        model = art.TrainableModel(name="agent", project="ttt", base_model=art.models.DEFAULT)
        await model.register(art.LocalBackend())
        panel = art.widgets.TrainingPanel(model, tic_tac_toe.rollout, scenarios=lambda step: [step, step + 1],
                                          group_size=8, train_config=art.TrainConfig(learning_rate=1e-3))
        panel        # then press the buttons; `await panel.wait()` in a cell waits for the running action

    score: optional `async score(group) -> group` (e.g. `lambda g: art.ruler_score_group(g, judge)`); Train
        step applies it to each gathered group before training, the Score button applies it on demand.
    """

    def __init__(
        self,
        model: TrainableModel,
        rollout: Rollout,
        scenarios: Scenarios,
        *,
        group_size: int = 8,
        score: Scorer | None = None,
        train_config: TrainConfig | None = None,
        max_exceptions: int | float = 0,
        steps: int = 5,
        metric: str = "reward",
    ) -> None:
        self.loop = TrainingLoop(
            model,
            rollout,
            scenarios,
            group_size=group_size,
            score=score,
            train_config=train_config,
            max_exceptions=max_exceptions,
        )
        self.model = model
        self._step = model.store.latest_step() or 0  # until refresh() asks the backend
        self.output = widgets.Output(layout={"max_height": "200px", "overflow": "auto"})
        self.background = Background(self.output)
        self.gather_button = widgets.Button(
            description="Gather", icon="download", tooltip="run one group per scenario"
        )
        self.score_button = widgets.Button(
            description="Score", icon="gavel", tooltip="score the gathered groups"
        )
        self.train_button = widgets.Button(
            description="Train step",
            icon="play",
            button_style="primary",
            tooltip="gather (if needed), score, train",
        )
        self.steps = widgets.BoundedIntText(value=steps, min=1, max=100_000, layout={"width": "70px"})
        self.run_button = widgets.Button(description="Run N steps", icon="forward")
        self.stop_button = widgets.Button(
            description="Stop", icon="stop", button_style="warning", tooltip="stop after the current phase"
        )
        self.gather_bar = widgets.IntProgress(value=0, min=0, max=1, description="gather", bar_style="info")
        self.train_bar = widgets.FloatProgress(value=0, min=0, max=1, description="train", bar_style="info")
        self.gather_text = widgets.Label()
        self.train_text = widgets.Label()
        self.status = widgets.HTML()
        self.engine = "…"
        self.note = ""
        self.plot = RewardPlot(model, metric=metric)
        self.off_policy = OffPolicyPlot(model)
        self.group_view = GroupView()
        self._show_last_trained()

        self.gather_button.on_click(lambda _: self._start("gather", self.loop.gather()))
        self.score_button.on_click(lambda _: self._start("score", self.loop.score()))
        self.train_button.on_click(lambda _: self._start("step", self.loop.step()))
        self.run_button.on_click(lambda _: self._start("run", self.loop.run(self.steps.value)))
        self.stop_button.on_click(lambda _: self.stop())
        self.loop.on(self._on_event)

        buttons = widgets.HBox(
            [
                self.gather_button,
                self.score_button,
                self.train_button,
                self.run_button,
                self.steps,
                self.stop_button,
            ],
            layout=widgets.Layout(flex_flow="row wrap"),
        )
        bars = widgets.VBox(
            [
                widgets.HBox([self.gather_bar, self.gather_text]),
                widgets.HBox([self.train_bar, self.train_text]),
            ]
        )
        super().__init__(
            [self.status, buttons, bars, self.output, self.plot, self.off_policy, self.group_view]
        )
        self.add_class("artnb-training-panel")
        self._update_controls()
        self._render_status()
        self._first_check = None
        if self.background.loop is not None:
            self._first_check = self.background.loop.create_task(self.refresh())

    def _show_last_trained(self) -> None:
        """A resumed run (a restarted kernel, a new panel) shows the groups of its newest trained step until
        this panel gathers its own."""
        store = self.model.store
        steps = [step for split, step in store.trajectory_files() if split == "train"]
        if not steps:
            return
        try:
            self.group_view.set_groups(store.read_trajectories("train", steps[-1]))
        except (OSError, ValueError) as error:  # a damaged file: the view stays empty and says why
            self.note = f"could not show step {steps[-1]}'s groups ({type(error).__name__}: {error})"

    # actions ------------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Finish the current phase, then stop (nothing is lost: pending groups stay for the next step)."""
        self.loop.stop()
        if self.loop.busy:
            self.note = "stopping after this phase…"
        self._update_controls()
        self._render_status()

    async def wait(self) -> None:
        """Wait until the running action (button press) has finished."""
        await self.background.wait()

    def _start(self, action: str, coro: Coroutine[Any, Any, Any]) -> None:
        if self.background.start(self._action(action, coro)):
            task = self.background.task
            assert task is not None  # start() returned True: it has just scheduled one
            task.add_done_callback(lambda _: self._update_controls())
            self._update_controls()

    async def _action(self, action: str, coro: Coroutine[Any, Any, Any]) -> Any:
        self.note = ""
        self.output.outputs = ()  # an earlier action's traceback is not about this one
        try:
            return await coro
        except Exception as error:  # said in the status line; Background shows the traceback
            message = str(error).split("\n", 1)[0]
            message = message if len(message) <= 120 else message[:119] + "…"
            self.note = f"{action} failed: {type(error).__name__}: {message} (details below)"
            raise
        finally:
            await self.refresh()

    async def refresh(self) -> None:
        """Re-check the engine and re-read the history (e.g. after training from a cell, not the buttons)."""
        self.engine = await self.loop.engine_state()
        with contextlib.suppress(Exception):  # not answering: engine_state says so; keep the last step known
            self._step = (
                await self.model.get_step()
            )  # through the backend: a remote run has no local checkpoints
        self.plot.refresh()
        self.off_policy.refresh()
        self._render_status()

    # events -------------------------------------------------------------------------------------------
    def _on_event(self, event: LoopEvent) -> None:
        if event.kind == "progress" and event.phase == "gather":
            self.gather_bar.max = max(int(event.total or 1), 1)
            self.gather_bar.value = int(event.done)
            self.gather_text.value = f"{int(event.done)}/{int(event.total or 0)} rollouts"
        elif event.kind == "progress" and event.phase == "score":
            self.gather_text.value = f"scored {int(event.done)}/{int(event.total or 0)} groups"
        elif event.kind == "progress" and event.phase == "train":
            self._train_progress(event.done, event.total)
        elif event.kind == "groups":
            self.group_view.set_groups(event.groups)
        elif event.kind == "trained" and event.result is not None:  # the loop's "trained" events carry it
            result = event.result
            self._step = result.step
            self.train_bar.bar_style = "success"
            loss = result.metrics.get(names.LOSS)
            if result.skipped:
                self.note = f"step {result.step}: no update ({result.skipped})"
            else:
                self.note = f"trained step {result.step}" + (
                    f" · loss {loss:.4g}" if loss is not None else ""
                )
        elif event.kind == "stopped":
            self.note = "stopped; gathered groups not yet trained are kept for the next Train step"
        elif event.kind == "phase":
            if event.phase == "gather":
                self.gather_bar.value = 0
            if event.phase == "train":
                self.train_bar.bar_style = "info"
                self.train_bar.value = 0
                self.engine = "held while training (requests wait)"
        self._update_controls()
        self._render_status()

    def _train_progress(self, elapsed: float, estimate: float | None) -> None:
        if estimate:
            self.train_bar.value = min(elapsed / estimate, 0.99 if elapsed < estimate else 1.0)
            self.train_text.value = f"{elapsed:.0f}s (last step took {estimate:.0f}s)"
        else:
            self.train_bar.value = 0.5
            self.train_text.value = f"{elapsed:.0f}s (first step: no estimate yet)"

    # view ---------------------------------------------------------------------------------------------
    def _update_controls(self) -> None:
        busy = self.loop.busy or self.background.running
        for b in (self.gather_button, self.train_button, self.run_button):
            b.disabled = busy
        self.score_button.disabled = busy or self.loop.scorer is None or not self.loop.pending
        self.stop_button.disabled = not busy or self.loop.stop_requested

    def _render_status(self) -> None:
        step = self.step
        pending = len(self.loop.pending)
        parts = [
            f"<b>{self.model.name}</b> · step <b>{step}</b>",
            f"phase: <b>{PHASE_TEXT[self.loop.phase]}</b>",
            f"engine: {self.engine}",
        ]
        if pending:
            scored = " (scored)" if self.loop.pending_scored else ""
            parts.append(f"{pending} groups gathered, not trained{scored}")
        if self.note:
            parts.append(f"<i>{html.escape(self.note)}</i>")
        for name, url in self.model.reporting.links():  # the W&B run, the Langfuse traces
            parts.append(f'<a href="{html.escape(url, quote=True)}" target="_blank">{html.escape(name)}</a>')
        self.status.value = " · ".join(parts)

    @property
    def step(self) -> int:
        """The model's newest step, as the backend last reported it."""
        return self._step
