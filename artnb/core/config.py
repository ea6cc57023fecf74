"""Configuration objects a user touches: LoRA shape, training options, engine settings.

Every field has a default that works on the embedded model on a CPU, and help text saying when to change it.
They are pydantic models so a typo in a keyword is an error, not a silently ignored option.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoRAConfig(_Strict):
    """Shape of the LoRA adapter that RL trains. RL needs little capacity: rank 1-32 is plenty."""

    r: int = Field(8, ge=1, description="adapter rank; RL carries ~1 bit per episode, so small ranks suffice")
    alpha: int = Field(16, ge=1, description="scaling numerator; alpha = 2*r is the usual choice")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout; keep 0 for RL")
    target_modules: list[str] = Field(
        default_factory=lambda: list(ALL_LINEAR),
        description="modules to adapt; all linear projections beat attention-only at the same rank",
    )


class TrainConfig(_Strict):
    """Options for one GRPO step. `model.train(groups, config=TrainConfig(...))` or keywords to `backend.train`.

    ART's default learning rate (5e-6) suits 3B-14B models; the embedded 135M model needs about 1e-3
    (measured: 1e-4 shows no trend in 20 steps), so the tutorials pass `learning_rate=1e-3` explicitly.
    """

    learning_rate: float = Field(5e-6, gt=0, description="AdamW learning rate for the LoRA weights")
    loss_fn: Literal["cispo", "ppo"] = Field(
        "cispo",
        description="'cispo': clipped stop-gradient IS weight times logprob (default, as ART since 2026); "
        "'ppo': token-level PPO clip objective",
    )
    epsilon: float | None = Field(None, ge=0, description="lower clip; default 0.2 for ppo, 1.0 for cispo")
    epsilon_high: float | None = Field(
        None, ge=0, description="upper clip; default epsilon for ppo, 4.0 for cispo (DAPO uses 0.28 with ppo)"
    )
    scale_rewards: bool = Field(
        True, description="divide group advantages by the group std (False = Dr. GRPO)"
    )
    kl_penalty_coef: float = Field(0.0, ge=0, description="weight of the k3 KL to the base model; 0 skips it")
    truncated_importance_sampling: float | None = Field(
        None, gt=0, description="cap on the engine/trainer probability ratio that weights each token's loss"
    )
    allow_training_without_logprobs: bool = Field(
        False, description="train assistant dicts with no sampling logprobs (plain REINFORCE on those turns)"
    )
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping threshold")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    micro_batch_tokens: int = Field(
        2048, ge=64, description="padded-token budget per forward/backward; lower it if memory runs out"
    )
    max_seq_length: int | None = Field(
        None,
        ge=16,
        description="drop longer sequences (counted in metrics); None = the model's context length",
    )
    on_nothing_to_train: Literal["raise", "skip"] = Field(
        "raise",
        description="a batch with no trajectories, or whose sequences are all over max_seq_length: 'raise' "
        "NothingToTrainError (the step does not advance, nothing is written); 'skip' records a skipped step "
        "in the history, still without a new checkpoint. Groups with equal rewards are not 'nothing': their "
        "step advances without an update",
    )

    @field_validator("learning_rate")
    @classmethod
    def _finite_lr(cls, v: float) -> float:
        if v != v or v == float("inf"):
            raise ValueError("learning_rate must be a finite positive number")
        return v

    def resolved_epsilons(self) -> tuple[float, float]:
        """(epsilon, epsilon_high) with the loss-specific defaults filled in."""
        if self.loss_fn == "ppo":
            eps = 0.2 if self.epsilon is None else self.epsilon
            return eps, eps if self.epsilon_high is None else self.epsilon_high
        eps = 1.0 if self.epsilon is None else self.epsilon
        return eps, 4.0 if self.epsilon_high is None else self.epsilon_high


class TrainerConfig(_Strict):
    """How the trainer runs (device and memory trade-offs), fixed for the life of a backend."""

    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="'auto' picks cuda when available")
    gradient_checkpointing: bool = Field(
        False, description="recompute activations in backward: ~40% less memory, ~30% slower"
    )
    seed: int = Field(0, description="seed for LoRA initialisation and dropout")
