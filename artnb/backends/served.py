"""The slot LocalBackend keeps for each registered model: its engine, trainer, tokenizer, run directory, and the
one thread its trainer works on.

Why a slot of its own: a training step (train_step.py), the HTTP transport behind `model.openai_client()` and the
run operations (run_operations.py) all need "this model's engine, serving the newest committed step" and "run this
on the trainer's thread". They get it from the slot, never from the backend's private members; the backend only
creates slots at register and closes them.

The engine is (re)started through `start_engine`, a function the backend gives the slot (engine_launch.py decides
which engine). An engine that died is restarted by the next `ensure_engine`; one that serves an older step than
the newest committed one loads the newest first.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from transformers import PreTrainedTokenizerBase

from ..core.contracts import Engine, Trainer
from ..core.model import TrainableModel
from ..core.store import RunLock, RunStore
from ..dev.settings import InternalSettings
from .machine_bill import HourlyBill

log = logging.getLogger("artnb")

T = TypeVar("T")
EngineStarter = Callable[[TrainableModel], Awaitable[Engine]]


@dataclass
class ServedModel:
    """One registered model: what serves it, what trains it, and where its run lives."""

    model: TrainableModel  # the newest object registered under this (project, name)
    base_path: str
    store: RunStore
    run_lock: RunLock
    engine: Engine
    trainer: Trainer
    tokenizer: PreTrainedTokenizerBase
    step: int  # the newest committed step (this process is the run's only writer)
    settings: InternalSettings  # what the model's `_internal_config` asks for (artnb/dev/settings.py)
    start_engine: EngineStarter  # starts a new engine for the model (after the old one died)
    trainer_thread: ThreadPoolExecutor
    serving_step: int | None = None  # the step whose adapter the engine serves as the plain name
    default_temperature: float | None = None  # for requests that name none (core/temperature.py); None: 1
    bill: HourlyBill | None = None  # the backend's price per hour, shared by its models (machine_bill.py)
    step_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one step (or run operation) at a time
    restart_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    failed_start: str | None = None  # why the last restart failed (the dead engine's exit code is old news)

    async def on_trainer_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the trainer's thread. All trainer work stays on one thread: glibc gives each thread
        its own malloc arena, and a trainer hopping across a pool's threads kept a multi-GB arena per thread
        (measured: out of memory at 19 GB). It runs in the caller's context, so that `artnb serve` sends the
        trainer's warnings (a skipped update, say) to the notebook that asked for the step."""
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self.trainer_thread, call)

    def engine_current(self) -> bool:
        """The engine is alive and serves the newest committed step."""
        return self.engine.alive() and self.serving_step == self.step

    def newest_evicted(self) -> None:
        """The engine let the newest step's adapter go (it keeps its newest few, and an older step was loaded
        for a request that named it): the next request through the model's client loads it again."""
        self.serving_step = None

    async def ensure_engine(self) -> None:
        """Restart the engine if its process died, and make it serve the newest committed step."""
        async with self.restart_lock:
            if not self.engine.alive():
                if self.failed_start is None:
                    log.warning(
                        "artnb: the inference engine for %r exited (code %s); restarting it. Its log: %s",
                        self.model.name,
                        self.engine.returncode,
                        self.store.logs,
                    )
                else:
                    log.warning(
                        "artnb: starting the inference engine for %r again; the last try failed: %s",
                        self.model.name,
                        self.failed_start,
                    )
                await self.engine.stop()
                try:
                    self.engine = await self.start_engine(self.model)
                except Exception as error:
                    self.failed_start = f"{type(error).__name__}: {error}"
                    raise
                self.failed_start = None
                self.serving_step = None
                self.point_model_at_engine()
                if self.default_temperature is not None:
                    await self.engine.set_default_temperature(self.default_temperature)
            if self.serving_step != self.step:
                await self.engine.load_adapter(
                    self.model.get_inference_name(self.step), str(self.store.checkpoint_path(self.step))
                )
                self.serving_step = self.step

    async def set_default_temperature(self, temperature: float) -> None:
        """What the engine samples at when a request names no temperature, now and after a restart."""
        self.default_temperature = temperature
        if self.engine.alive():  # else ensure_engine sets it on the restarted engine
            await self.engine.set_default_temperature(temperature)

    def point_model_at_engine(self) -> None:
        """The model's inference address: where `model.openai_client()` and ART-style clients send requests."""
        self.model.inference_base_url = self.engine.base_url
        self.model.inference_api_key = self.engine.api_key
        self.model.inference_model_name = self.model.name

    async def load_checkpoint(self, step: int) -> None:
        """Make checkpoint `step` (already in the run directory) the model's newest: trainer and engine."""
        await self.on_trainer_thread(self.trainer.load_checkpoint, self.store.checkpoint_path(step))
        self.step = step
        await self.ensure_engine()

    async def stop(self) -> None:
        """Stop the engine and the trainer's processes (if it has any), and let the trainer's thread end."""
        try:
            await self.engine.stop()
        finally:
            try:
                await self.on_trainer_thread(self.trainer.close)
            finally:
                self.trainer_thread.shutdown(wait=False)

    def stop_now(self) -> None:
        """`stop` for synchronous callers (`with LocalBackend() as backend:`)."""
        try:
            self.engine.stop_now()
        finally:
            self.trainer.close()
            self.trainer_thread.shutdown(wait=False)
