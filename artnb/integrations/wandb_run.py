"""Weights & Biases: one W&B run per model with its history rows, config and sampled trajectories.

On when the model asks (`report_metrics=["wandb"]`) or, ART's rule, when `report_metrics` is None, the model is
trainable and `WANDB_API_KEY` is set; otherwise wandb is never imported. Each run:
- has a stable id (`model.run_id`, else `model.id`, else one derived from project and name), so a restarted
  kernel resumes the same run (`resume="allow"`); its files live in the run directory (`RunStore.wandb_dir`);
- logs each history row once, against `training_step` (the row's step: the policy that produced the data), so
  train and val rows may arrive in any order; non-numeric and non-finite values are left out;
- keeps the model (name, project, base model, LoRA, the user's `config`) and the latest TrainConfig in its
  config, a table of up to TABLE_ROWS sampled trajectories per logged batch, and the newest checkpoint's path
  in its summary.
W&B runs in its own worker thread: `wandb.init` (which waits up to INIT_TIMEOUT_S, or $WANDB_INIT_TIMEOUT, for a
server) and every log
call happen there, so the notebook's event loop never waits on W&B. A failure warns once and W&B is dropped for
the rest of the run; training goes on.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import sys
import threading
from collections.abc import Sequence
from dataclasses import asdict, is_dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from ..core import metric_names as names
from ..core.ignored import warn_user
from . import numeric_metrics, sample_trajectories

if TYPE_CHECKING:
    from ..core.model import Model
    from ..core.trajectory import TrajectoryGroup

TABLE_ROWS = 32  # trajectories per logged batch in the W&B table (a fixed-seed sample of larger batches)
INIT_TIMEOUT_S = 30.0
CLOSE_TIMEOUT_S = 60.0  # how long close() waits for W&B to write what it holds
STEP_METRIC = names.STEP_AXIS


def enabled(model: Model) -> bool:
    if model.report_metrics is not None:
        return "wandb" in model.report_metrics
    return model.trainable and bool(os.environ.get("WANDB_API_KEY"))


def reporter_for(model: Model) -> WandbReporter | None:
    return WandbReporter(model) if enabled(model) else None


def run_id(model: Model) -> str:
    """The model's W&B run id: `run_id` or `id` when given, else `{project}-{storage_name}` made W&B-safe, plus a short
    hash when that changed it (W&B ids take letters, digits, '-' and '_')."""
    if model.run_id or model.id:
        return str(model.run_id or model.id)
    raw = f"{model.project}-{model.storage_name}"
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", raw)
    return safe if safe == raw else f"{safe}-{hashlib.sha1(raw.encode()).hexdigest()[:8]}"


class WandbReporter:
    """The W&B run of one model, fed by a worker thread (see the module docstring)."""

    name = "W&B"

    def __init__(self, model: Model) -> None:
        self.url: str | None = None
        self.run_id = run_id(model)
        self._queue: queue.Queue = queue.Queue()
        self._failed = False
        init = {
            "project": model.project,
            "name": model.storage_name,
            "id": self.run_id,
            "entity": model.entity,
            "resume": "allow",
            "config": run_config(model),
            "dir": str(model.store.wandb_dir),
        }
        model.store.wandb_dir.mkdir(parents=True, exist_ok=True)
        if "weave" in sys.modules:  # wandb.init will start Weave in the worker thread
            from .weave_init import import_what_weave_imports_late

            import_what_weave_imports_late()
        self._thread = threading.Thread(target=self._work, args=(init,), name="artnb-wandb", daemon=True)
        self._thread.start()

    # called by the seam (artnb/integrations/__init__.py) -----------------------------------------------------
    def log_row(
        self, model: Model, row: dict[str, Any], groups: Sequence[TrajectoryGroup], config: BaseModel | None
    ) -> None:
        if self._failed:
            return
        step, split = int(row["step"]), str(row.get("split", "train"))
        data: dict[str, Any] = {STEP_METRIC: step, **numeric_metrics(row)}
        table = _table_rows(step, split, groups) if groups else None
        checkpoint = None
        if split == "train" and model.trainable and row.get("commit"):
            checkpoint = str(model.store.checkpoint_path(step + 1))
        train_config = config.model_dump(mode="json") if config is not None else None
        self._queue.put(("log", split, data, table, checkpoint, train_config))

    def update_config(self, values: dict[str, Any]) -> None:
        self._queue.put(("config", values))

    def instrument(self, model: Model, client: Any) -> None:
        """W&B does not trace requests (Weave and Langfuse do)."""

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(CLOSE_TIMEOUT_S)

    # the worker ------------------------------------------------------------------------------------------
    def _work(self, init: dict[str, Any]) -> None:
        run = None
        try:
            import wandb

            timeout = float(os.environ.get("WANDB_INIT_TIMEOUT", INIT_TIMEOUT_S))  # W&B's own variable
            if os.environ.get("WANDB_MODE") in ("offline", "disabled", "dryrun"):
                # wandb.init starts Weave when weave is imported (ART's notebooks import it). Weave needs the W&B
                # server: offline it asks for a login on stdin, and in this thread that read can wait forever
                # (the run never records). W&B's own switch, unless the user set it.
                os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")
            settings = wandb.Settings(init_timeout=timeout, console="off", silent=True)
            run = wandb.init(**init, reinit="create_new", settings=settings)
            run.define_metric(STEP_METRIC)
            run.define_metric("*", step_metric=STEP_METRIC)
            self.url = None if run.offline else run.url
            while (item := self._queue.get()) is not None:
                self._apply(wandb, run, item)
        except Exception as error:
            self._failed = True
            warn_user(
                f"artnb: W&B stopped recording this run ({type(error).__name__}: {error}); training goes on "
                "without it (this warning is shown once)"
            )
        finally:
            if run is not None:
                try:
                    run.finish()
                except Exception:  # already warned, or nothing more W&B can do
                    pass

    @staticmethod
    def _apply(wandb: Any, run: Any, item: tuple) -> None:
        if item[0] == "config":
            run.config.update(item[1], allow_val_change=True)
            return
        _, split, data, table, checkpoint, train_config = item
        if train_config is not None:
            run.config.update({"train_config": train_config}, allow_val_change=True)
        if table is not None:
            data[names.split_metric(split, names.TRAJECTORIES_TABLE)] = wandb.Table(
                columns=list(_COLUMNS), data=table
            )
        if checkpoint is not None:
            run.summary["checkpoint"] = checkpoint
        run.log(data)


_COLUMNS = ("step", "split", "group", "index", "reward", "metrics", "messages")


def _table_rows(step: int, split: str, groups: Sequence[TrajectoryGroup]) -> list[list[Any]]:
    """Up to TABLE_ROWS trajectories of the batch (a sample seeded by the step, so a rerun picks the same)."""
    return [
        [step, split, g, i, float(t.reward), json.dumps(t.metrics, default=str), _conversation(t.messages())]
        for g, i, t in sample_trajectories(step, groups, TABLE_ROWS)
    ]


def _conversation(messages: list[dict[str, Any]]) -> str:
    lines = []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, str):
            content = json.dumps(content, default=str) if content is not None else ""
        calls = m.get("tool_calls")
        if calls:
            content += " " + json.dumps(calls, default=str)
        lines.append(f"{m.get('role', '?')}: {content}")
    return "\n".join(lines)


def run_config(model: Model) -> dict[str, Any]:
    config: dict[str, Any] = {"model": {"name": model.name, "project": model.project}}
    for field in ("base_model", "lora"):
        value = getattr(model, field, None)
        if value is not None:
            config["model"][field] = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
    user = model.config
    if isinstance(user, BaseModel):
        config["config"] = user.model_dump(mode="json")
    elif is_dataclass(user) and not isinstance(user, type):
        config["config"] = asdict(user)
    elif isinstance(user, dict):
        config["config"] = user
    return config
