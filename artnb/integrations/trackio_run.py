"""Trackio: a local, free experiment tracker (Hugging Face's `trackio`), one Trackio run per model.

On only when the model asks: `report_metrics=["trackio"]` (alone, or with "wandb"). Each run:
- lives in Trackio's project `model.project`, named `model.storage_name`, resumed by that name after a
  kernel restart (`resume="allow"`); Trackio keeps it in its local database ($TRACKIO_DIR, by default
  ~/.cache/huggingface/trackio), and `trackio show --project <project>` opens the dashboard;
- logs each history row once at the row's step (the policy that produced the data), numeric values only;
- keeps the model, the latest TrainConfig and `model.update_wandb_config(...)` values as the run's config (Trackio
  stores a config with a logged row: a change reaches its database with the next row);
- logs up to TRACES sampled trajectories per batch as Trackio traces (the chat, with split, step, group, index,
  reward and metrics as metadata).
Trackio writes from a worker thread of its own here, so the notebook's event loop never waits on its database;
a failure warns once and Trackio is dropped for the rest of the run.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from ..core.ignored import warn_user
from . import numeric_metrics, sample_trajectories
from .wandb_run import run_config

if TYPE_CHECKING:
    from ..core.model import Model
    from ..core.trajectory import TrajectoryGroup

TRACES = 32  # trajectories per logged batch, sampled with the step as seed (as the W&B table)
CLOSE_TIMEOUT_S = 60.0


def reporter_for(model: Model) -> TrackioReporter | None:
    if "trackio" not in (model.report_metrics or ()):
        return None
    if importlib.util.find_spec("trackio") is None:
        raise ImportError(
            "report_metrics=['trackio'] needs the trackio package: pip install 'artnb[trackio]'"
        )
    return TrackioReporter(model)


class TrackioReporter:
    """The Trackio run of one model (see the module docstring)."""

    name = "Trackio"

    def __init__(self, model: Model) -> None:
        self.url: str | None = None  # a local dashboard has no address until `trackio show` starts one
        self.project, self.run_name = model.project, model.storage_name
        self._failed = False
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="artnb-trackio")
        self._run = self._worker.submit(self._init, run_config(model))

    def _init(self, config: dict[str, Any]) -> Any:
        import trackio

        return trackio.init(
            project=self.project,
            name=self.run_name,
            config=config,
            resume="allow",
            embed=False,
            auto_log_cpu=False,
            auto_log_gpu=False,
        )

    def log_row(
        self, model: Model, row: dict[str, Any], groups: Sequence[TrajectoryGroup], config: BaseModel | None
    ) -> None:
        if self._failed:
            return
        step, split = int(row["step"]), str(row.get("split", "train"))
        data = numeric_metrics(row)
        traces = [
            (
                t.messages(),
                {
                    "split": split,
                    "step": step,
                    "group": g,
                    "index": i,
                    "reward": float(t.reward),
                    **t.metrics,
                },
            )
            for g, i, t in sample_trajectories(step, groups, TRACES)
        ]
        train_config = config.model_dump(mode="json") if config is not None else None
        self._worker.submit(self._log, step, split, data, traces, train_config)

    def _log(self, step: int, split: str, data: dict, traces: list, train_config: dict | None) -> None:
        try:
            import trackio

            run = self._run.result()
            if train_config is not None and run.config.get("train_config") != train_config:
                _update_config(run, {"train_config": train_config})
            if data:
                run.log(data, step=step)
            for messages, metadata in traces:
                run.log({f"{split}/trajectories": trackio.Trace(messages, metadata=metadata)}, step=step)
        except Exception as error:
            if not self._failed:
                self._failed = True
                warn_user(
                    f"artnb: Trackio stopped recording this run ({type(error).__name__}: {error}); training goes "
                    "on without it (this warning is shown once)"
                )

    def update_config(self, values: dict[str, Any]) -> None:
        self._worker.submit(lambda: _update_config(self._run.result(), values))

    def instrument(self, model: Model, client: Any) -> None:
        """Trackio does not trace requests."""

    def close(self) -> None:
        def finish() -> None:
            if self._run.exception() is None:
                self._run.result().finish()

        try:
            self._worker.submit(finish).result(CLOSE_TIMEOUT_S)
        finally:
            self._worker.shutdown(wait=False)


def _update_config(run: Any, values: dict[str, Any]) -> None:
    run.config.update(values)
    if hasattr(run, "_config_logged"):  # Trackio sends a config once, with the first row; send it again
        run._config_logged = False
