"""One settings object for a script that runs in three places, as a dataclass with defaults that run on a laptop CPU.

A training script runs in three places: this CPU (quick mode, the embedded 135M model), a Colab GPU (a real model
such as Qwen2.5-3B-Instruct, `quick=False`), and Binder (about 2 GB of RAM). Everything those places change lives
here, so a script changes one line and the rest reads (the tutorial notebooks once did this; they now set their
own parameter cell, so that a reader sees every setting):

    settings = art.tutorial.Settings(base_model=art.models.DEFAULT, quick=True)
    backend = settings.backend()
    await model.register(backend)
    await model.train(groups, config=settings.train_config())

Binder's start script sets `ARTNB_LOW_MEMORY=1`: the HF engine (vLLM does not fit), gradient checkpointing and
small micro-batches.

On a GPU the settings pick the card's preset for the base model (`gpu`, from backends/gpu_presets.py: vLLM's
memory share, context length, 4-bit or 16-bit trainer weights, micro-batch size); the backend and the TrainConfig
follow it. Without CUDA `gpu` is None and nothing changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import models
from .backends.gpu_presets import GPUPreset
from .backends.local import LocalBackend
from .core.config import TrainConfig, low_memory_requested
from .core.ignored import warn_user

SMALL_MODEL_LR = 1e-3  # measured: the 135M model needs ~1e-3 (1e-4 showed no trend in 20 steps)
LARGE_MODEL_LR = 1e-5  # the usual LoRA RL rate for 3B-14B models


@dataclass
class Settings:
    """What a tutorial's parameter cell decides. Quick mode: a few small steps that show the loop works."""

    base_model: str = models.DEFAULT  # on a Colab GPU: "Qwen/Qwen2.5-3B-Instruct"
    quick: bool = True  # False: enough steps and games to see learning (a GPU, or an hour of CPU)
    low_memory: bool = field(default_factory=low_memory_requested)  # Binder: ~2 GB of RAM
    path: str = "./.art"  # the run directory; a rerun resumes from its newest checkpoint
    steps: int | None = None  # RL steps; None: 1 quick, 30 otherwise
    groups_per_step: int | None = None  # scenarios per step; None: 2 quick, 4 otherwise
    group_size: int | None = None  # rollouts per scenario (GRPO compares these); None: 4 quick, 8 otherwise
    eval_scenarios: int | None = None  # evaluation games per model; None: 4 quick, 32 otherwise
    learning_rate: float | None = None  # None: 1e-3 for the embedded or tiny models, 1e-5 for real ones
    # None: this card's preset for base_model when there is a GPU; stays None on a CPU
    gpu: GPUPreset | None = None

    def __post_init__(self) -> None:
        quick = self.quick
        self.steps = self.steps if self.steps is not None else (1 if quick else 30)
        self.groups_per_step = self.groups_per_step or (2 if quick else 4)
        self.group_size = self.group_size or (4 if quick else 8)
        self.eval_scenarios = self.eval_scenarios or (4 if quick else 32)
        if self.group_size < 2:
            raise ValueError(f"group_size={self.group_size}: GRPO compares rollouts, so use at least 2")
        if self.learning_rate is None:
            self.learning_rate = SMALL_MODEL_LR if self.small_model else LARGE_MODEL_LR
        if self.gpu is None:
            self.gpu = _detected_preset(self.base_model)

    @property
    def small_model(self) -> bool:
        """The embedded model or a tiny test model, which need a far larger learning rate than real ones."""
        return self.base_model == models.DEFAULT or "tiny-llama" in self.base_model

    def backend(self, **options: Any) -> LocalBackend:
        """A LocalBackend for this place: vLLM when installed ("auto"); in low-memory mode LocalBackend itself
        picks the HF engine and gradient checkpointing (`ARTNB_LOW_MEMORY`)."""
        kwargs: dict[str, Any] = {
            "path": self.path,
            "engine": "auto",
            "gpu_preset": self.gpu or "auto",
            "low_memory": self.low_memory,
        }
        return LocalBackend(**{**kwargs, **options})

    def train_config(self, **options: Any) -> TrainConfig:
        """The TrainConfig for this model size and place; keywords override (`settings.train_config(...)`)."""
        values: dict[str, Any] = {"learning_rate": self.learning_rate}
        if self.gpu is not None:
            values["micro_batch_tokens"] = self.gpu.micro_batch_tokens
        if self.low_memory:
            values["micro_batch_tokens"] = 512
        return TrainConfig(**{**values, **options})

    def scenarios(self, step: int, offset: int = 0) -> list[int]:
        """The training scenarios (seeds) of `step`: new ones every step, never the evaluation ones."""
        n = self.groups_per_step
        if n is None:  # __post_init__ sets it; only a later `settings.groups_per_step = None` gets here
            raise ValueError("settings.groups_per_step is None: set it to the number of scenarios per step")
        return [offset + step * n + i for i in range(n)]

    def evaluation_scenarios(self, offset: int = 1_000_000) -> list[int]:
        """Seeds kept apart from training, the same for every model compared."""
        if self.eval_scenarios is None:  # as in scenarios(): only a later assignment of None gets here
            raise ValueError("settings.eval_scenarios is None: set it to the number of evaluation games")
        return [offset + i for i in range(self.eval_scenarios)]


def _detected_preset(base_model: str) -> GPUPreset | None:
    """This card's preset for `base_model`; None without CUDA (nothing is read) or when the model's config does
    not say its shape (LocalBackend then says why)."""
    from .backends.gpu_presets import detect_card, preset_for

    card = detect_card()
    if card is None:
        return None
    try:
        return preset_for(models.resolve_base_model(base_model), card=card)
    except (ValueError, OSError) as error:
        warn_user(f"artnb: no GPU preset for {base_model} ({error}); the backend uses its defaults")
        return None
