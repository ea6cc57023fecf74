"""The contracts the layers meet at: a Backend (what models, loops and widgets call), an Engine (what serves
inference) and a Trainer (what updates the adapter).

Why Protocols: `LocalBackend` (this machine) and `RemoteBackend` (an `artnb serve` server) must be
interchangeable under `model.register(backend)`, and the backend must be able to swap engines (vLLM, the HF
engine) and trainers without the rest of artnb reading their private fields. The methods listed here are the
whole surface each side may use; `runtime_checkable` lets tests check an implementation against it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import httpx

    from .config import TrainConfig
    from .model import Model, TrainableModel
    from .tokenize import TokenizedSequence
    from .train_request import SFTRequest, TrainOutcome, TrainRequest, TrainResult
    from .trajectory import Message, Trajectory, TrajectoryGroup


@runtime_checkable
class Backend(Protocol):
    """Serves and trains models; what `Model`, `TrainableModel`, the training loop and the widgets rely on."""

    path: Path  # the run directories this process reads: the runs themselves, or a local mirror of them

    async def register(self, model: Model) -> None:
        """Serve a TrainableModel (resuming its run); give any model the backend's place for its logs."""
        ...

    async def get_step(self, model: TrainableModel) -> int:
        """The newest committed step of the model's run."""
        ...

    async def train_step(self, model: TrainableModel, request: TrainRequest) -> TrainOutcome:
        """One GRPO step, committed with its history row and rollouts; what it committed, for the model to
        record (TrainableModel.train builds the request and records the outcome)."""
        ...

    async def train_sft_step(self, model: TrainableModel, request: SFTRequest) -> TrainOutcome:
        """One SFT step, committed like a GRPO step."""
        ...

    async def train(
        self, model: TrainableModel, trajectory_groups: Iterable[TrajectoryGroup], **options: Any
    ) -> TrainResult:
        """ART's spelling of `model.train(trajectory_groups, **options)`."""
        ...

    async def train_sft(
        self, model: TrainableModel, trajectories: Iterable[Trajectory], **options: Any
    ) -> TrainResult:
        """ART's spelling of `model.train_sft(trajectories, **options)`."""
        ...

    async def log(
        self, model: Model, split: str, step: int, row: dict[str, Any], groups: Sequence[TrajectoryGroup]
    ) -> None:
        """Record a history row and the groups' trajectories for `split` at `step` in the model's run."""
        ...

    async def delete_checkpoints(self, model: TrainableModel, best_checkpoint_metric: str) -> list[int]:
        """Delete every checkpoint but the latest and the best; the deleted steps."""
        ...

    def http_client(self, model: TrainableModel) -> httpx.AsyncClient:
        """The HTTP client behind `model.openai_client()`."""
        ...

    async def set_default_temperature(self, model: TrainableModel, temperature: float) -> None:
        """The temperature the model's engine samples at when a request names none (temperature.py), kept
        across engine restarts."""
        ...

    async def close(self) -> None:
        """Stop serving and release what the backend holds."""
        ...


@runtime_checkable
class Engine(Protocol):
    """An OpenAI-compatible inference server with runtime LoRA loading (engines/hf/, engines/vllm/)."""

    api_key: str
    unanswered_s: float  # a request waiting this long has `answers()` checked (engine_transport.py)

    @property
    def base_url(self) -> str: ...
    @property
    def log_path(self) -> Path: ...
    async def start(self, timeout: float = ...) -> None: ...
    async def stop(self) -> None: ...
    def stop_now(self) -> None: ...
    def alive(self) -> bool: ...
    @property
    def returncode(self) -> int | None: ...
    async def load_adapter(self, lora_name: str, lora_path: str) -> None: ...
    async def unload_adapter(self, lora_name: str) -> None: ...
    async def hold(self) -> None:
        """New requests wait (they do not fail) until release; returns once running requests finished."""

    async def release(self) -> None: ...
    async def stats(self) -> dict[str, Any]: ...
    async def answers(self, timeout_s: float = ...) -> bool:
        """Whether the server answers its health check within `timeout_s` (False: hung or stopped)."""
        ...

    async def set_default_temperature(self, temperature: float | None) -> None:
        """The temperature for requests that name none (None: the engine's own, 1), from the next request on."""


@runtime_checkable
class InProcessJudge(Protocol):
    """A RULER judge that scores in this process, with no requests, cache or rate limits (`art.LocalJudge`,
    artnb/local_judge.py); RULER and the preflight take one wherever they take a judge."""

    @property
    def label(self) -> str:
        """How reports and panels name the judge."""
        ...

    async def score(
        self, distinct: Sequence[Sequence[Message]], rubric: str, tools: list[dict[str, Any]] | None = None
    ) -> list[tuple[float, str]]:
        """(score in [0, 1], explanation) for each conversation, in order, relative to each other."""
        ...


@runtime_checkable
class Trainer(Protocol):
    """Updates a LoRA adapter on token sequences (trainers/peft_trainer.py); knows nothing of trajectories."""

    @property
    def max_seq_length(self) -> int: ...
    def train(
        self, sequences: list[TokenizedSequence], config: TrainConfig, *, progress: bool = True
    ) -> dict[str, float]: ...
    def train_sft(
        self,
        sequences: list[TokenizedSequence],
        learning_rate: float,
        *,
        max_grad_norm: float = ...,
        weight_decay: float = ...,
        micro_batch_tokens: int = ...,
    ) -> dict[str, float]: ...
    def save_checkpoint(self, path: str | Path) -> None: ...
    def load_checkpoint(self, path: str | Path) -> None: ...
    def reset_optimizer(self) -> None: ...
    def free_memory(self) -> None:
        """Release cached accelerator memory after a step, before the engine on the same GPU wakes."""

    def close(self) -> None:
        """Stop what the trainer runs outside this process (the FSDP trainer's ranks); the backend calls it once
        it no longer serves the model."""
