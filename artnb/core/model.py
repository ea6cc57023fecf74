"""Models a rollout talks to: `Model` (any OpenAI-compatible endpoint) and `TrainableModel` (trained by a backend).

Differences from OpenPipe ART, on purpose:
- `model.train(...)` returns the `TrainResult` (ART discarded it) and is not deprecated.
- `backend.train(...)` logs the step's rewards, trainer metrics and trajectories itself, so nothing is lost when
  a loop forgets `model.log(..., split="train")`.
- Train metrics are recorded at the step of the policy that produced the rollouts, the same x-axis as `val`.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import statistics
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidatorFunctionWrapHandler, field_validator

from . import costs
from . import metric_names as names
from .config import LoRAConfig, TrainConfig, art_lora_fields, check_internal_config
from .ignored import report_ignored, warn_user
from .metrics_builder import MetricsBuilder
from .names import check_name, check_split, check_step
from .reporting import ModelReporting, metric_names, what_reports
from .store import RunInUseError, RunStore
from .train_request import CommittedWhileCancelled, SFTRequest, TrainOutcome, TrainRequest, TrainResult
from .trajectory import PendingGroup, Trajectory, TrajectoryGroup, check_trajectories, real_number

if TYPE_CHECKING:
    from openai import AsyncOpenAI

    from .contracts import Backend
    from .sft import TrainSFTConfig
    from .temperature import LinearTemperatureAnnealer


class NothingToTrainError(ValueError):
    """The batch has nothing a step could learn from; the step did not advance and nothing was written."""


ModelConfig = TypeVar("ModelConfig", bound=BaseModel | None)


@dataclass
class _TrainedBatch:
    """The groups the newest step trained on, so that ART's `model.log(groups, split="train", step=result.step)`
    after `backend.train` merges into that step's record instead of recording the batch a second time."""

    groups: list[TrajectoryGroup]
    steps: tuple[int, int]  # the policy step that produced them and the step the training made
    commit: str
    row: dict[str, Any]


class Model(BaseModel, Generic[ModelConfig]):
    """A model behind any OpenAI-compatible endpoint (a hosted API, a local server): evaluated, not trained.

    `config` holds your own settings for the rollout (any pydantic model; `art.Model[MyConfig]` in type hints),
    saved with the run. Example, a comparison model:
        gpt = art.Model(name="gpt-4.1-mini", project="tic-tac-toe", inference_model_name="gpt-4.1-mini",
                        inference_base_url="https://api.openai.com/v1", inference_api_key=os.environ["OPENAI_API_KEY"])
        await gpt.register(backend)          # logs go to the backend's path next to the trained model
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    name: str
    project: str = "default"
    config: ModelConfig | None = None
    inference_base_url: str | None = None
    inference_api_key: str | None = Field(default=None, repr=False)  # never in reprs, logs or model.json
    inference_model_name: str | None = None
    base_path: str = "./.art"
    trainable: bool = False
    # ART 0.5's W&B identity: the entity and run id of the model's W&B run (integrations/wandb_run.py)
    entity: str | None = None
    id: str | None = None
    run_id: str | None = None
    report_metrics: list[str] | None = None  # "wandb", "trackio"; None: W&B when WANDB_API_KEY is set
    # the run: its directory under {base_path}/{project}/models/ and its W&B and Trackio name (default: `name`,
    # which stays the name the model is served under), as in ART 0.5.2x
    run_name: str | None = None
    _backend: Backend | None = PrivateAttr(default=None)
    _openai_client: Any = PrivateAttr(default=None)
    _client_key: tuple | None = PrivateAttr(default=None)
    _trained: _TrainedBatch | None = PrivateAttr(default=None)
    _reporting: ModelReporting | None = PrivateAttr(default=None)  # W&B, Trackio, Langfuse (reporting.py)
    _costs: MetricsBuilder = PrivateAttr(default_factory=MetricsBuilder)

    @field_validator("name", "project")
    @classmethod
    def _safe_folder_name(cls, value: str, info: Any) -> str:
        return check_name(value, info.field_name)

    @field_validator("run_name")
    @classmethod
    def _safe_run_name(cls, value: str | None) -> str | None:
        return None if value is None else check_name(value, "run_name")

    @property
    def storage_name(self) -> str:
        """The name of the run directory, `{base_path}/{project}/models/{storage_name}`: `run_name` when given
        (ART 0.5.2x: a fresh run under the same served name), else `name`."""
        return self.run_name or self.name

    @field_validator("config", mode="wrap")
    @classmethod
    def _own_config_model(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """Unparametrised, `config`'s type is pydantic's bare BaseModel, which turns a dict into an empty
        object (its data lost) that later fails in repr and model_dump; ART does the same, so refuse it here."""
        config = handler(value)
        if type(config) is BaseModel and type(value) is not BaseModel:
            raise TypeError(
                f"config must be an instance of your own pydantic model (got {type(value).__name__}); define "
                "`class MyConfig(pydantic.BaseModel): max_turns: int = 5` and pass config=MyConfig(max_turns=5)"
            )
        return config

    def openai_client(self) -> AsyncOpenAI:
        """An AsyncOpenAI client for this model's endpoint (created once, recreated if the endpoint changes)."""
        from openai import AsyncOpenAI

        if not self.inference_base_url:
            raise RuntimeError(
                f"model {self.name!r} has no inference_base_url: "
                + (
                    "call `await model.register(backend)` first"
                    if self.trainable
                    else "pass inference_base_url (and inference_api_key)"
                )
            )
        key = (self.inference_base_url, self.inference_api_key)
        if self._openai_client is None or self._client_key != key:
            self._openai_client = AsyncOpenAI(
                base_url=self.inference_base_url,
                api_key=self.inference_api_key or "none",
                timeout=1200,
                http_client=self._http_client(),
            )
            self._client_key = key
            self._count_client_costs(self._openai_client)
            self.reporting.client_created(self._openai_client)
        return self._openai_client

    def _count_client_costs(self, client: AsyncOpenAI) -> None:
        """A hosted model's calls: its tokens and price under costs/model/{name} (TrainableModel: see
        set_cost_calculator)."""
        if not self.trainable:
            _count_costs(client, f"model/{self.name}", self.inference_model_name, self._costs)

    @property
    def reporting(self) -> ModelReporting:
        """Where this model's history rows and clients are reported: the W&B, Trackio and Langfuse reporters
        artnb/integrations registers, those asked for started on first use (core/reporting.py)."""
        if self._reporting is None:
            self._reporting = ModelReporting(self)
        return self._reporting

    def update_wandb_config(self, config: dict[str, Any]) -> None:
        """Add `config` to the model's W&B run config (ART's call); nothing happens when W&B is off for it."""
        for reporter in self.reporting.reporters():
            update_config = getattr(reporter, "update_config", None)
            if update_config is not None:
                update_config(config)

    def metrics_builder(self, cost_context: str | None = None) -> MetricsBuilder:
        """What this model's next history row takes its `costs/`, `time/`, `data/` and `throughput/` values from
        (ART's call): `measure`, `add_data`, `add_idle_times`, `register_model_pricing` (metrics_builder.py).
        `cost_context` is kept as a label; cost names carry their source here (e.g. `judge/ruler`)."""
        if cost_context is not None:
            self._costs.cost_context = cost_context
        return self._costs

    def activate_metrics_context(
        self, context: MetricsBuilder | str | None = None, *, cost_context: str | None = None
    ) -> costs.Activation:
        """Make API spend recorded from here on (RULER, `art.metrics.track_api_cost`) this model's: in a
        `with` block until it ends, or, called alone (ART's style), for the rest of the current task.
        `context` is a builder, or a cost-context name ("train", "eval") for this model's own builder;
        `cost_context=` is ART's keyword for the name."""
        if cost_context is not None:
            if context is not None:
                raise TypeError(
                    "activate_metrics_context takes a builder or name as `context` or a name as `cost_context`, "
                    "not both"
                )
            context = cost_context
        if context is None or isinstance(context, str):
            context = self.metrics_builder(context)
        return costs.Activation(context)

    def backend(self) -> Backend:
        """The backend this model is registered with (ART's call); before `register`, a ValueError (ART's type)."""
        if self._backend is None:
            raise ValueError(
                f"model {self.name!r} is not registered with a backend: call `await model.register(backend)` first"
            )
        return self._backend

    def safe_model_dump(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """`model_dump(...)` with `config` set to None (ART's call): the user's config may hold values that do
        not serialise, and what receives the dump needs the model's identity, not the rollout settings."""
        data = self.model_dump(*args, **kwargs)
        data["config"] = None
        return data

    async def register(self, backend: Backend) -> None:
        """Attach this model to `backend`: a TrainableModel starts serving (engine, checkpoint resume); any model
        then logs into the backend's run directory (`backend.path`)."""
        if self.config is not None:
            try:
                self.config.model_dump_json()
            except Exception as error:
                raise ValueError(
                    f"model {self.name!r}: its config cannot be saved as JSON ({error}); use JSON-friendly "
                    "field types (str, numbers, lists, dicts, nested pydantic models)"
                ) from error
        for name in set(self.report_metrics or ()) - set(metric_names()):
            report_ignored(f"report_metrics=[{name!r}]", what_reports())
        previous = (self._backend, self.base_path)
        self._backend = backend
        self.base_path = str(backend.path)
        try:
            await backend.register(self)
        except RunInUseError:
            # the run is another process's to write, and this model's to read (model.history()) meanwhile
            self._backend = previous[0]
            if previous[0] is not None:
                self.base_path = previous[1]
            raise
        except BaseException:
            self._backend, self.base_path = previous
            raise

    def _http_client(self):
        return None

    def get_inference_name(self, step: int | None = None) -> str:
        name = self.inference_model_name or self.name
        return name if step is None else f"{name}@{step}"

    def litellm_completion_params(self, step: int | None = None) -> dict[str, Any]:
        """Keyword arguments for `litellm.acompletion` that reach this model."""
        model = self.get_inference_name(step)
        if self.trainable:
            model = f"hosted_vllm/{model}"
        return {
            "model": model,
            "base_url": self.inference_base_url,
            "api_key": self.inference_api_key,
            "temperature": 1.0,
        }

    @property
    def store(self) -> RunStore:
        return RunStore(self.base_path, self.project, self.storage_name)

    async def get_step(self) -> int:
        return 0

    async def log(
        self,
        trajectories: Iterable[TrajectoryGroup | Trajectory] | TrajectoryGroup | None = None,
        split: str = "val",
        *,
        metrics: dict[str, float] | None = None,
        step: int | None = None,
    ) -> dict[str, Any]:
        """Record rewards and metrics (history.jsonl) and the trajectories (parquet) for a split and step.

        `trajectories` may hold groups, trajectories and exceptions (failed rollouts, counted in exception_rate).
        Logging the batch the newest training step trained on (ART's loop: `model.log(groups, split="train",
        metrics=result.metrics, step=result.step)`) adds only metrics that step's record lacks: `train()`
        recorded the batch already. Returns the history row.
        """
        # everything is checked before anything is drained, merged or written: history.jsonl is append-only
        groups = _as_groups(trajectories)
        split = check_split(split)
        step = None if step is None else check_step(step)
        given = _checked_metrics(metrics)
        check_trajectories(groups, then="Nothing was logged", for_training=False)
        metric_row = {k if "/" in k else names.split_metric(split, k): v for k, v in given.items()}
        metric_row = {**costs.drain_for(self._costs), **metric_row}
        trained = self._trained
        if split == "train" and trained is not None and _same_groups(groups, trained.groups):
            if step is None or step in trained.steps:
                return await self._merge_into_trained(trained, metric_row)
        step = await self.get_step() if step is None else step
        row: dict[str, Any] = {"step": step, "split": split}
        row.update({names.split_metric(split, k): v for k, v in summarize_groups(groups).items()})
        row.update(metric_row)
        await self._write_log(split, step, row, groups)
        return row

    async def _merge_into_trained(self, trained: _TrainedBatch, metrics: dict[str, Any]) -> dict[str, Any]:
        # ART's loop passes back `result.metrics`, whose data/ values the row holds as train/ ones
        new = {
            k: v for k, v in names.drop_duplicates({**trained.row, **metrics}).items() if k not in trained.row
        }
        if new:
            step = trained.steps[0]
            await self._write_log(
                "train", step, {"step": step, "split": "train", "commit": trained.commit, **new}, []
            )
            trained.row.update(new)
        return dict(trained.row)

    async def _write_log(
        self, split: str, step: int, row: dict[str, Any], groups: list[TrajectoryGroup]
    ) -> None:
        """Through the backend when registered (it may be remote), else into the local run directory."""
        if self._backend is not None:
            await self._backend.log(self, split, step, row, groups)
        else:
            if groups:
                self.store.write_trajectories(split, step, groups)
            self.store.append_history(row)
        self.reporting.row_logged(row, groups)

    async def _record(
        self, groups: list[TrajectoryGroup], outcome: TrainOutcome, config: TrainConfig
    ) -> None:
        """What a train step this model asked for committed: kept, so that ART's `model.log(groups,
        split="train")` merges into it, and reported (W&B, Trackio, Langfuse), with the judges' spend."""
        committed = outcome.committed
        if committed is None:
            return
        self._trained = _TrainedBatch(groups, committed.steps, committed.commit, dict(committed.row))
        self.reporting.row_logged(committed.row, groups, config)
        if spent := costs.drain_for(self._costs):  # what judges and hosted models cost during this step
            await self._merge_into_trained(self._trained, spent)

    def history(self):
        """The logged history as a pandas DataFrame: a row per training step and per `model.log` call (logging the
        batch a step just trained merges into that step's row)."""
        return self.store.history()

    def read_state(self) -> dict[str, Any] | None:
        """The state saved in the run directory (state.json), or None when none was saved yet (as in ART, so
        that `if state := model.read_state():` tells a fresh run from a resumed one)."""
        store = self.store
        return store.read_state() if store.state_path.exists() else None

    def overwrite_state(self, state: dict[str, Any]) -> None:
        """Replace the saved state with `state` (a dict of JSON values)."""
        self.store.write_state(state)

    def write_state(self, state: dict[str, Any]) -> None:
        """Deprecated in ART: `overwrite_state` (replace) or `merge_state` (update). Replaces the state."""
        warnings.warn(
            "write_state() is deprecated: use overwrite_state() (replaces the state) or merge_state()",
            DeprecationWarning,
            stacklevel=2,
        )
        self.overwrite_state(state)

    def merge_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """Deep-merge `state` into the saved state (nested dicts merge, other values replace); returns the
        merged state as saved."""
        merged = _deep_merge(self.read_state() or {}, state)
        self.store.write_state(merged)
        return merged


class TrainableModel(Model[ModelConfig]):
    """A model whose LoRA adapter a backend trains. `await model.register(backend)` starts serving it.

    `base_model`: a Hugging Face id or path, `art.models.DEFAULT` (the embedded SmolLM2-135M), or a LoRA adapter
    directory (e.g. one SFT wrote) to start from. ART's `_internal_config=art.dev.InternalModelConfig(...)` (or
    assigning `model._internal_config`) and `lora_config=art.dev.LoRAConfig(...)` are accepted; what they mean
    here is decided in artnb/dev/settings.py.
    """

    trainable: bool = True
    base_model: str
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    _internal_config: dict[str, Any] | None = PrivateAttr(default=None)
    _temperature_annealer: Any = PrivateAttr(default=None)  # ART's LinearTemperatureAnnealer (temperature.py)
    _default_temperature: float | None = PrivateAttr(default=None)
    _temperature_task: Any = PrivateAttr(default=None)  # the task sending a default set after register
    _cost_calculator: CostCalculator | None = PrivateAttr(default=None)

    def __init__(
        self,
        *,
        _internal_config: Mapping[str, Any] | None = None,
        lora_config: Mapping[str, Any] | None = None,
        **data: Any,
    ) -> None:
        if lora_config is not None:
            if "lora" in data:
                raise ValueError("pass either lora= (artnb's LoRAConfig) or lora_config= (ART's), not both")
            data["lora"] = LoRAConfig(**art_lora_fields("lora_config", lora_config))
        super().__init__(**data)
        self._internal_config = check_internal_config(_internal_config)

    @property
    def cost_calculator(self) -> CostCalculator:
        """ART's calculator of this model's inference costs (see set_cost_calculator); one that prices nothing
        until one is set."""
        return self._cost_calculator or _no_costs

    def set_cost_calculator(self, calculator: CostCalculator | None) -> None:
        """Price this model's own chat completions (ART's call), e.g. what a hosted trainer bills per token.

        Each non-streamed completion made through `openai_client()` while a metrics context is active
        (`model.activate_metrics_context("train")`) calls `calculator(prompt_tokens, completion_tokens,
        cost_context)`: prompt tokens once per returned choice, the active context's name ("train", "eval").
        Each `costs/<name>` key it returns adds its value in USD to that context as `costs/<name>/usd` (artnb's
        cost names end in their kind); other keys are left out. None stops pricing."""
        if calculator is not None and not callable(calculator):
            raise TypeError(
                f"set_cost_calculator takes a function (prompt_tokens, completion_tokens, cost_context) -> "
                f"{{'costs/<name>': usd}}, or None (got {type(calculator).__name__})"
            )
        self._cost_calculator = calculator

    def _count_client_costs(self, client: AsyncOpenAI) -> None:
        _count_calculated_costs(client, self)

    @property
    def internal_config(self) -> Mapping[str, Any] | None:
        """What ART's `_internal_config` asks for (None when nothing), for the backend to apply."""
        return self._internal_config

    async def register(
        self, backend: Backend, _openai_client_config: Mapping[str, Any] | None = None
    ) -> None:
        """Start serving this model on `backend` (see Model.register). ART's `_openai_client_config`
        (`art.dev.OpenAIServerConfig`: how ART starts its vLLM server) is honoured for its `engine_args`,
        which join `_internal_config["engine_args"]` (winning over the same keys there); its `server_args`
        and `log_file` are reported as ignored: artnb's engines choose their own host, port, key, parsers
        and log file."""
        if _openai_client_config is not None:
            self._internal_config = _with_server_config(self._internal_config, _openai_client_config)
        await super().register(backend)
        await self._send_default_temperature()

    @property
    def default_temperature(self) -> float | None:
        """The temperature the model's engine samples at when a request names none: the temperature annealer's
        current one, or None (the engine's own default, 1)."""
        return self._default_temperature

    def set_temperature_annealer(self, annealer: LinearTemperatureAnnealer) -> None:
        """ART's temperature annealing: requests that name no temperature sample at the annealer's first value
        from now on, and at its next value after each `model.train` (core/temperature.py). Set before
        `register`, as ART's examples do, or after: then the engine takes it as soon as this cell yields (in a
        script outside any event loop, before this returns)."""
        if not callable(getattr(annealer, "step", None)):
            raise TypeError(
                f"set_temperature_annealer takes an annealer with a step() method, e.g. "
                f"art.LinearTemperatureAnnealer(start=1.0, end=0.1, steps=10); got {type(annealer).__name__}"
            )
        self._temperature_annealer = annealer
        self._default_temperature = float(annealer.step())
        if self._backend is not None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # a script between two asyncio.run calls: send it now, on a loop of its own
                asyncio.run(self._send_default_temperature())
                return
            self._temperature_task = loop.create_task(self._send_default_temperature())

    async def _send_default_temperature(self) -> None:
        if self._default_temperature is not None and self._backend is not None:
            await self._backend.set_default_temperature(self, self._default_temperature)

    def _require_backend(self):
        if self._backend is None:
            raise RuntimeError(
                f"model {self.name!r} is not registered: call `await model.register(backend)` first"
            )
        return self._backend

    def _http_client(self):
        return self._require_backend().http_client(self)

    def get_inference_name(self, step: int | None = None) -> str:
        """`name` (served as the latest step) or `name@step` for a specific checkpoint."""
        return self.name if step is None else f"{self.name}@{step}"

    async def get_step(self) -> int:
        return await self._require_backend().get_step(self)

    async def train(
        self,
        trajectory_groups: Iterable[TrajectoryGroup],
        config: TrainConfig | None = None,
        _config: Mapping[str, Any] | None = None,
        verbose: bool = False,
        **options: Any,
    ) -> TrainResult:
        """One GRPO step on the groups; inference waits meanwhile and then serves the new adapter.

        `config` fields are overridden by ART's `_config` dict of training keywords, then by keyword `options`
        (see TrainConfig); `verbose` prints the step's metrics. ART's `backend.train(model, groups, ...)` is
        this call.
        """
        trajectory_groups = _train_batch(trajectory_groups)
        _check_train_configs(config, _config)
        if _config is not None:
            options["_config"] = _config
        if verbose:
            options["verbose"] = True
        backend = self._require_backend()
        request = TrainRequest.build(trajectory_groups, config, options)
        try:
            outcome = await backend.train_step(self, request)
        except CommittedWhileCancelled as cancelled:
            await self._record(request.groups, cancelled.outcome, request.config)
            await self._anneal_temperature()
            _say_committed(cancelled.outcome, "these groups")
            raise
        await self._record(request.groups, outcome, request.config)
        await self._anneal_temperature()
        return outcome.result

    async def _anneal_temperature(self) -> None:
        if self._temperature_annealer is not None:  # ART: each train call moves the schedule on
            self._default_temperature = float(self._temperature_annealer.step())
            await self._send_default_temperature()

    async def train_sft(
        self,
        trajectories: Iterable[Trajectory],
        config: TrainSFTConfig | None = None,
        _config: Mapping[str, Any] | None = None,
        verbose: bool = False,
        log_metrics: bool = True,
        **options: Any,
    ) -> TrainResult:
        """Supervised fine-tuning on the trajectories' assistant turns (one optimizer step per `batch_size`
        trajectories), committed as one step; inference waits meanwhile and then serves the new adapter.

        >>> await model.train_sft(trajectories, art.TrainSFTConfig(batch_size=4))

        `_config` is a dict of TrainSFTConfig fields (ART's experimental `dev.TrainSFTConfig`), and keyword
        `options` override fields too (`learning_rate=1e-4, batch_size=4`); `verbose` prints a summary. Returns the TrainResult (ART returns None). For a JSONL file or a learning-rate schedule see
        `artnb.utils.sft.train_sft_from_file` and `create_sft_dataset_iterator`.

        `log_metrics=False` (ART's) keeps the step's metrics out of W&B, Trackio and Langfuse. The step still
        commits, and its history row is still written to history.jsonl: it is part of the step's commit
        record (which tells the next step that the optimizer last made an SFT update).
        """
        from .sft import sft_step_line

        backend = self._require_backend()
        if _config is not None:
            options["_config"] = _config
        request = SFTRequest.build(trajectories, config, options)
        if not log_metrics:
            report_ignored(
                "train_sft(log_metrics=False) for history.jsonl",
                "an SFT step's history row is part of its commit; it is only kept from W&B, Trackio and Langfuse",
            )
        try:
            outcome = await backend.train_sft_step(self, request)
        except CommittedWhileCancelled as cancelled:
            if cancelled.outcome.committed is not None and log_metrics:
                self.reporting.row_logged(cancelled.outcome.committed.row, config=request.config)
            _say_committed(cancelled.outcome, "these trajectories")
            raise
        if outcome.committed is not None and log_metrics:
            self.reporting.row_logged(outcome.committed.row, config=request.config)
        if verbose:
            print(sft_step_line(outcome.result.step, outcome.result.metrics, len(request.trajectories)))
        return outcome.result

    async def delete_checkpoints(
        self, best_checkpoint_metric: str = names.BEST_CHECKPOINT_METRIC
    ) -> list[int]:
        """Delete every checkpoint except the latest and the one with the best mean `best_checkpoint_metric`."""
        return await self._require_backend().delete_checkpoints(self, best_checkpoint_metric)

    def as_base_model(self) -> Model:
        """The base model without any adapter, on this model's engine: a baseline for evaluations, and a judge
        for RULER that needs no API key (`art.ruler_score_group(group, model.as_base_model())`).

        >>> base = model.as_base_model()
        >>> await base.openai_client().chat.completions.create(model=base.get_inference_name(), ...)
        """
        self._require_backend()
        if not self.inference_base_url:
            raise RuntimeError(
                f"model {self.name!r} is not being served: `await model.register(backend)` first"
            )
        base = _BaseOf(
            name=f"{self.storage_name}-base",
            project=self.project,
            base_path=self.base_path,
            inference_base_url=self.inference_base_url,
            inference_api_key=self.inference_api_key,
            inference_model_name=self.base_model,
        )
        base._owner = self
        return base


class _BaseOf(Model):
    """`TrainableModel.as_base_model()`: requests go through the owner's transport, which follows engine restarts."""

    _owner: Any = PrivateAttr(default=None)

    def _http_client(self):
        return self._owner._http_client()


def _as_groups(trajectories: Any) -> list[TrajectoryGroup]:
    """The groups `model.log` records, from ART's forms: groups, trajectories and exceptions (one group of
    them), or one group. Anything else is a TypeError naming it: it used to be dropped, logging an empty row."""
    if trajectories is None:
        return []
    if isinstance(trajectories, TrajectoryGroup):
        return [trajectories]
    wanted = "model.log takes a list of art.TrajectoryGroup (or of art.Trajectory)"
    if isinstance(trajectories, Trajectory):
        raise TypeError(f"{wanted} (got one Trajectory); pass it in a list: model.log([trajectory])")
    if isinstance(trajectories, Mapping):
        raise TypeError(
            f"{wanted} (got {type(trajectories).__name__}); numbers go to metrics: "
            "model.log(metrics={'accuracy': 0.8}, split='val')"
        )
    if _unawaited(trajectories) or isinstance(trajectories, str) or not isinstance(trajectories, Iterable):
        raise TypeError(f"{wanted} (got {type(trajectories).__name__}); {_group_fix(trajectories)}")
    groups: list[TrajectoryGroup] = []
    loose: list[Trajectory | BaseException] = []
    for i, item in enumerate(trajectories):
        if isinstance(item, TrajectoryGroup):
            groups.append(item)
        elif isinstance(item, (Trajectory, BaseException)):
            loose.append(item)
        else:
            raise TypeError(f"{wanted} (got {type(item).__name__} at index {i}); {_group_fix(item)}")
    if loose:
        groups.append(TrajectoryGroup(loose))
    return groups


def _unawaited(value: Any) -> bool:
    return isinstance(value, PendingGroup) or inspect.isawaitable(value)


def _group_fix(item: Any) -> str:
    """How to turn a wrong item of a batch into the groups `log` and `train` take."""
    if isinstance(item, PendingGroup):
        return (
            "await the group first: `group = await art.TrajectoryGroup(...)`, or "
            "`groups = await art.gather_trajectory_groups([...])`"
        )
    if inspect.isawaitable(item):
        return "await it first (e.g. `groups = await art.gather_trajectory_groups([...])`)"
    if isinstance(item, (list, tuple)):
        return "wrap trajectories in art.TrajectoryGroup([...]): one group per scenario"
    if isinstance(item, Mapping):
        return "make each rollout an art.Trajectory(messages_and_choices=[...], reward=...)"
    return "pass the groups that `await art.gather_trajectory_groups([...])` returns"


def _with_server_config(
    internal: Mapping[str, Any] | None, server_config: Mapping[str, Any]
) -> dict[str, Any] | None:
    """`internal` (an `_internal_config`) with the engine_args of ART's OpenAIServerConfig merged in."""
    if not isinstance(server_config, Mapping):
        raise TypeError(
            f"_openai_client_config takes art.dev.OpenAIServerConfig(engine_args=..., server_args=...), a dict "
            f"(got {type(server_config).__name__})"
        )
    for key in sorted(set(server_config) - {"engine_args"}):
        report_ignored(
            f"register(_openai_client_config={{{key!r}: ...}})",
            "artnb's engines choose their own host, port, API key, tool parsers and log file"
            if key in ("server_args", "log_file")
            else "OpenAIServerConfig has log_file, server_args and engine_args; only engine_args apply here",
        )
    engine_args = server_config.get("engine_args")
    if not engine_args:
        return check_internal_config(internal)
    if not isinstance(engine_args, Mapping):
        raise TypeError(
            f"_openai_client_config['engine_args'] takes a dict, e.g. art.dev.EngineArgs(enforce_eager=True) "
            f"(got {type(engine_args).__name__})"
        )
    merged = dict(internal or {})
    merged["engine_args"] = {**(merged.get("engine_args") or {}), **engine_args}
    return check_internal_config(merged)


def _train_batch(trajectory_groups: Any) -> Any:
    """`trajectory_groups` if it is a batch of groups (a generator becomes a list, since it is read twice);
    a TypeError with the fix for a single group, an un-awaited gather and lists of trajectories."""
    wanted = "train() takes a list of art.TrajectoryGroup"
    if isinstance(trajectory_groups, TrajectoryGroup):
        raise TypeError(f"{wanted} (got one TrajectoryGroup); wrap it in a list: model.train([group])")
    if _unawaited(trajectory_groups) or not isinstance(trajectory_groups, Iterable):
        raise TypeError(f"{wanted} (got {type(trajectory_groups).__name__}); {_group_fix(trajectory_groups)}")
    if not isinstance(trajectory_groups, Sequence):
        trajectory_groups = list(trajectory_groups)
    for i, item in enumerate(trajectory_groups):
        if not isinstance(item, TrajectoryGroup):
            raise TypeError(f"{wanted} (got {type(item).__name__} at index {i}); {_group_fix(item)}")
    return trajectory_groups


def _say_committed(outcome: TrainOutcome, what: str) -> None:
    """The stop button pressed while the trainer ran: the step committed first, so the cell's batch is trained
    and running the cell again would train it a second time."""
    step = outcome.result.step
    warn_user(
        f"artnb: interrupted while training, after the trainer had started: step {step} was committed first, so "
        f"{what} are trained and the model serves step {step}. Running the cell again would train them twice; "
        "gather a new batch instead"
    )


def _check_train_configs(config: Any, dev_config: Any) -> None:
    """`config` and `_config` are easy to swap (ART's dev.TrainConfig is a dict); say which goes where."""
    if config is not None and not isinstance(config, TrainConfig):
        raise TypeError(
            f"config takes art.TrainConfig(...) (got {type(config).__name__}); ART's dev settings "
            "(art.dev.TrainConfig, a dict) go to `_config=`: model.train(groups, _config={...}), and single "
            "settings may be keywords: model.train(groups, learning_rate=1e-5)"
        )
    if dev_config is not None and not isinstance(dev_config, Mapping):
        raise TypeError(
            f"_config takes ART's dev settings as a dict (got {type(dev_config).__name__}); pass "
            "art.TrainConfig(...) as `config=` instead"
        )


def _checked_metrics(metrics: Any) -> dict[str, int | float | bool]:
    """`metrics` with numpy scalars as Python numbers; a TypeError naming the key of a value that is not a
    number. history.jsonl is append-only, so one text value would break its plots for the life of the run."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        hint = " (dict(pairs) makes one from a list of pairs)" if isinstance(metrics, (list, tuple)) else ""
        raise TypeError(
            f"metrics must be a dict of name -> number (got {type(metrics).__name__}); pass e.g. "
            f"metrics={{'accuracy': 0.8}}{hint}"
        )
    checked: dict[str, int | float | bool] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not key:
            raise TypeError(
                f"metric names must be non-empty strings (got {key!r}); name it, e.g. metrics={{'accuracy': 0.8}}"
            )
        number = real_number(value)
        if number is None:
            raise TypeError(
                f"metrics[{key!r}] must be a number (got {type(value).__name__} {value!r:.60}); log an int, "
                "float or bool (e.g. 1.0 for yes, 0.0 for no), or leave the key out; nothing was logged"
            )
        checked[key] = number
    return checked


def _same_groups(a: list[TrajectoryGroup], b: list[TrajectoryGroup]) -> bool:
    return len(a) == len(b) > 0 and all(x is y for x, y in zip(a, b, strict=True))


def summarize_groups(groups: Sequence[TrajectoryGroup]) -> dict[str, float]:
    """Mean reward, mean within-group reward std, exception rate, the mean of every trajectory metric and of
    every group metric (`group_<name>`)."""
    trajs = [t for g in groups for t in g.trajectories]
    n_exc = sum(len(g.exceptions) for g in groups)
    out: dict[str, float] = {}
    if not trajs and not n_exc:
        return out
    out["num_trajectories"] = len(trajs)
    out["exception_rate"] = n_exc / (len(trajs) + n_exc)
    if trajs:
        # non-finite rewards (a logged validation game that scored NaN) are left out, as metrics' are
        rewards = [float(t.reward) for t in trajs if math.isfinite(t.reward)]
        if rewards:
            out["reward"] = statistics.fmean(rewards)
        finite = [[float(r) for r in g.rewards() if math.isfinite(r)] for g in groups]
        stds = [statistics.pstdev(rs) for rs in finite if len(rs) > 1]
        if stds:
            out[names.std_of("reward")] = statistics.fmean(stds)
        keys = sorted({k for t in trajs for k in t.metrics})
        for k in keys:
            vals = [float(t.metrics[k]) for t in trajs if k in t.metrics]
            vals = [v for v in vals if math.isfinite(v)]
            if vals:
                out[k] = statistics.fmean(vals)
    # group-level metrics, as group_<name> (ART's way)
    for k in sorted({k for g in groups for k in g.metrics}):
        vals = [float(g.metrics[k]) for g in groups if k in g.metrics]
        vals = [v for v in vals if math.isfinite(v)]
        if vals:
            out[f"group_{k}"] = statistics.fmean(vals)
    return out


def _deep_merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


CostCalculator = Callable[[int | None, int | None, str], Mapping[str, float]]


def _no_costs(
    prompt_tokens: int | None, completion_tokens: int | None, cost_context: str
) -> dict[str, float]:
    return {}


def _after_completions(client: Any, see: Callable[[Any, dict[str, Any]], None]) -> None:
    """Call `see(response, request_kwargs)` after each chat completion `client` makes."""
    create = client.chat.completions.create

    async def seen(*args: Any, **kwargs: Any) -> Any:
        response = await create(*args, **kwargs)
        see(response, kwargs)
        return response

    client.chat.completions.create = seen


def _count_calculated_costs(client: Any, model: TrainableModel) -> None:
    """Price each (non-streamed) chat completion `client` makes with `model`'s cost calculator, read at each
    call, so that a calculator set after the client was made counts too."""

    def price(response: Any, _: dict[str, Any]) -> None:
        calculator, ledger = model._cost_calculator, costs.active()
        context = getattr(ledger, "cost_context", None)
        usage = getattr(response, "usage", None)
        if calculator is None or ledger is None or not context or usage is None:
            return  # ART prices only inside a named metrics context
        choices = max(len(getattr(response, "choices", None) or []), 1)
        priced = calculator(
            (usage.prompt_tokens or 0) * choices, usage.completion_tokens or 0, context.strip("/")
        )
        for key, usd in priced.items():
            if key.startswith("costs/"):
                ledger.add(key.removeprefix("costs/"), usd=float(usd), requests=0)

    _after_completions(client, price)


def _count_costs(client: Any, source: str, model_name: str | None, ledger: MetricsBuilder) -> None:
    """Record the usage and price of each (non-streamed) chat completion `client` makes into `ledger`."""

    def count(response: Any, request: dict[str, Any]) -> None:
        if getattr(response, "usage", None) is not None:
            costs.record(source, response, model=request.get("model") or model_name, ledger=ledger)

    _after_completions(client, count)
