"""Configuration objects a user touches: LoRA shape, training options, engine settings.

Every field has a default that works on the embedded model on a CPU, and help text saying when to change it.
They are pydantic models so a typo in a keyword is an error, not a silently ignored option.

ART's training keywords (`backend.train(model, groups, **kwargs)`, `model.train(groups, config, _config=...)`)
are resolved in one place, `resolve_train_config`: a keyword is a TrainConfig field, or an ART name mapped onto
one (`beta`, `normalize_advantages`, `ppo`), or an infrastructure knob with no meaning here, accepted and reported
once per process by name (`_IGNORED`); anything else is a TypeError that lists the valid names.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from .ignored import report_ignored
from .names import nearest

if TYPE_CHECKING:
    from .grpo import LossSettings

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoRAConfig(_Strict):
    """Shape of the LoRA adapter that RL trains. RL needs little capacity: rank 1-32 is plenty."""

    r: int = Field(
        default=8, ge=1, description="adapter rank; RL carries ~1 bit per episode, so small ranks suffice"
    )
    alpha: int = Field(default=16, ge=1, description="scaling numerator; alpha = 2*r is the usual choice")
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="LoRA dropout; keep 0 for RL")
    target_modules: list[str] = Field(
        default_factory=lambda: list(ALL_LINEAR),
        description="modules to adapt; all linear projections beat attention-only at the same rank",
    )


# ART's LoRA keywords (its own and peft's spellings) -> LoRAConfig fields
ART_LORA_KEYS = {"r": "r", "rank": "r", "lora_alpha": "alpha", "alpha": "alpha", "lora_dropout": "dropout"}
ART_LORA_KEYS |= {"dropout": "dropout", "target_modules": "target_modules"}
# the rest of ART's PeftArgs (0.3-0.4) and LoRAConfig (0.5) keys: accepted, reported once as ignored
ART_LORA_IGNORED = frozenset(
    """bias layers_to_transform layers_pattern use_gradient_checkpointing random_state max_seq_length use_rslora
    modules_to_save init_lora_weights init_weights loftq_config temporary_location""".split()
)


def _python_path(dotted: str) -> str:
    """A dotted path as Python writes it: _internal_config.init_args -> _internal_config["init_args"]."""
    first, *rest = dotted.split(".")
    return first + "".join(f'["{part}"]' for part in rest)


def unknown_art_key(path: str, key: str, known: Iterable[str], honoured: Iterable[str]) -> ValueError:
    """The error for `key` under `path` (dotted, as "_internal_config.init_args") that neither artnb nor ART
    has: a typo would otherwise be reported as an ignored ART option, and the setting silently not applied."""
    where = _python_path(path)
    close = nearest(key, known)
    fix = f"did you mean {' or '.join(map(repr, close))}?" if close else "check the spelling"
    return ValueError(
        f"unknown key in {where}, one neither artnb nor ART has (got {key!r}); {fix} The keys artnb uses "
        f"there: {', '.join(honoured)}"
    )


def check_internal_config(config: object) -> dict[str, Any] | None:
    """`config` as the dict a model keeps (None for none); a TypeError naming the fix for anything else.

    For the places that first take an `_internal_config` (`TrainableModel(_internal_config=...)`), so that a
    string or a list is refused there, not at `register` as a puzzling conversion error.
    """
    if config is None:
        return None
    if not isinstance(config, Mapping):
        raise TypeError(
            f"_internal_config takes a dict (got {type(config).__name__} {config!r:.60}); pass "
            "art.dev.InternalModelConfig(init_args=art.dev.InitArgs(max_seq_length=8192), ...)"
        )
    return dict(config)


def art_lora_fields(section: str, args: Mapping[str, Any]) -> dict[str, Any]:
    """LoRAConfig fields from ART's `lora_config` (or `_internal_config`'s `peft_args`, `section` naming where the
    dict was given: "lora_config" or "_internal_config.peft_args"). A near miss of a key artnb uses (`rnak`) is a
    ValueError with the nearest names; other keys (ART's, PEFT's) are reported once as having no effect.
    Example: `art_lora_fields("lora_config", {"lora_alpha": 32})` -> `{"alpha": 32}`."""
    if not isinstance(args, Mapping):
        raise TypeError(
            f"{_python_path(section)} must be a dict (got {type(args).__name__} {args!r:.60}); pass e.g. "
            "lora_config=art.dev.LoRAConfig(rank=16, alpha=32)"
        )
    fields: dict[str, Any] = {}
    for key, value in args.items():
        if key in ART_LORA_KEYS:
            fields[ART_LORA_KEYS[key]] = value
        elif key not in ART_LORA_IGNORED and nearest(key, ART_LORA_KEYS, cutoff=0.7):
            raise unknown_art_key(section, key, {*ART_LORA_KEYS, *ART_LORA_IGNORED}, ART_LORA_KEYS)
        else:  # ART's other keys, and PEFT's own (use_dora, ...) that ART passes on
            report_ignored(f"{section}.{key}", "artnb's LoRA has rank, alpha, dropout and targets")
    _check_lora_values(section, args, fields)
    return fields


def _check_lora_values(section: str, args: Mapping[str, Any], fields: dict[str, Any]) -> None:
    """A ValueError naming the key as the user wrote it (`rank`, `lora_alpha`) when LoRAConfig refuses a value;
    from `_internal_config` the refusal would otherwise come at register, naming artnb's field instead."""
    try:
        LoRAConfig(**fields)
    except ValidationError as error:
        problem = error.errors()[0]
        field = str(problem["loc"][0])
        key = next((k for k in args if ART_LORA_KEYS.get(k) == field), field)
        raise ValueError(
            f'{_python_path(section)}["{key}"]: {problem["msg"]} (got {args.get(key)!r}); fix it, e.g. '
            "art.dev.LoRAConfig(rank=16, alpha=32, dropout=0.0)"
        ) from None


class TrainConfig(_Strict):
    """Options for one GRPO step. `model.train(groups, config=TrainConfig(...))` or keywords to `backend.train`.

    ART's default learning rate (5e-6) suits 3B-14B models; the embedded 135M model needs about 1e-3
    (measured: 1e-4 shows no trend in 20 steps), so the tutorials pass `learning_rate=1e-3` explicitly.
    ART's keywords that are not fields here (`normalize_advantages`, `ppo`, GPU knobs) are resolved by
    `resolve_train_config`; `beta` is accepted here too, as the old name of `kl_penalty_coef`.
    """

    learning_rate: float = Field(default=5e-6, gt=0, description="AdamW learning rate for the LoRA weights")
    loss_fn: Literal["cispo", "ppo"] = Field(
        default="cispo",
        description="'cispo': clipped stop-gradient IS weight times logprob (default, as ART since 2026); "
        "'ppo': token-level PPO clip objective",
    )
    epsilon: float | None = Field(
        default=None, ge=0, description="lower clip; default 0.2 for ppo, 1.0 for cispo"
    )
    epsilon_high: float | None = Field(
        default=None,
        ge=0,
        description="upper clip; default epsilon for ppo, 4.0 for cispo (DAPO uses 0.28 with ppo)",
    )
    importance_sampling_level: Literal["token", "sequence", "average", "geometric_average"] = Field(
        default="token",
        description="'token': each token's own ratio; 'sequence': GSPO (arXiv 2507.18071), the geometric mean "
        "of the sequence's token ratios, clipped per sequence and shared by its tokens (steadier on long "
        "completions and MoE models); 'average' / 'geometric_average': ART's mixes of the two. It matters only "
        "off-policy (engine/trainer mismatch, rollouts from older steps). The epsilon defaults do not change with "
        "the level (as in ART and TRL): with loss_fn='ppo' pass GSPO's epsilon=3e-4, epsilon_high=4e-4, since a "
        "geometric-mean ratio rarely leaves [0.8, 1.2]",
    )
    scale_rewards: bool = Field(
        default=True,
        description="divide group advantages by the group std (False = Dr. GRPO; ART's normalize_advantages=False)",
    )
    advantage_balance: float = Field(
        default=0.0,
        ge=-1,
        le=1,
        description="b > 0 scales negative advantages by 1 - b (1: learn only from better-than-average "
        "trajectories), b < 0 scales positive ones by 1 + b. ART renormalises advantages afterwards; artnb does "
        "not, so |b| also shrinks the step",
    )
    kl_penalty_coef: float = Field(
        default=0.0,
        ge=0,
        validation_alias=AliasChoices("kl_penalty_coef", "beta"),
        description="weight of the k3 KL to the base model (ART 0.3-0.4 call it beta); 0 skips the reference "
        "forward pass. Try 0.01-0.1 if the policy drifts into degenerate text",
    )
    max_negative_advantage_importance_sampling_weight: float | None = Field(
        default=None,
        gt=0,
        description="cap c on the importance ratio, r <- min(r, c), on every token as ART does; under ppo it "
        "only changes negative-advantage tokens, whose unclipped r*A the min keeps. Set it (e.g. 2-5) when "
        "off-policy negative samples make the loss spike",
    )
    mask_prob_ratio: bool = Field(
        default=False,
        description="drop tokens whose ratio leaves the clip range (no loss, no gradient) instead of clipping "
        "their ratio (masked importance sampling)",
    )
    kimi_k2_tau: float | None = Field(
        default=None,
        description="Kimi K2's tau: A_t <- A_t - tau (new_t - old_t), a pull back towards the sampling policy; "
        "leave None unless reproducing K2",
    )
    truncated_importance_sampling: float | None = Field(
        default=None,
        gt=0,
        description="cap on the engine/trainer probability ratio that weights each token's loss",
    )
    precalculate_logprobs: bool = Field(
        default=False,
        description="before the update, recompute the old logprobs with the trainer itself (no grad, eval "
        "mode) instead of using the engine's, so the ratio holds only the policy change and not the "
        "engine/trainer numerical mismatch; truncated_importance_sampling then weights by trainer/engine. One "
        "extra forward pass. A step here is one update, so the ratio is then ~1 (REINFORCE plus that weight)",
    )
    num_trajectories_learning_rate_multiplier_power: float = Field(
        default=0.0,
        description="multiply the step's learning rate by (trajectories trained on)^power: 0.5 is the "
        "square-root batch-size rule (the loss is a token mean, so a bigger batch alone does not step further)",
    )
    allow_training_without_logprobs: bool = Field(
        default=False,
        description="train assistant dicts with no sampling logprobs (plain REINFORCE on those turns)",
    )
    max_grad_norm: float = Field(default=1.0, gt=0, description="gradient clipping threshold")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay")
    micro_batch_tokens: int = Field(
        default=2048,
        ge=64,
        description="padded-token budget per forward/backward; lower it if memory runs out",
    )
    max_seq_length: int | None = Field(
        default=None,
        ge=16,
        description="longer rollouts train on their first max_seq_length tokens (data/num_truncated_too_long; "
        "SFT drops longer examples); None = the model's context length",
    )
    logprob_calculation_chunk_size: int | None = Field(
        default=1024,
        ge=1,
        description="positions per LM-head + log_softmax chunk, so the [positions, vocab] logits never exist "
        "whole (each chunk is recomputed in backward, ~5% more compute). Lower it if the logits run out of "
        "memory (a large vocabulary, a long micro-batch); None computes them in one go",
    )
    verbose: bool = Field(
        default=False, description="print the trainer's metrics when the step's update is done"
    )
    on_nothing_to_train: Literal["raise", "skip"] = Field(
        default="raise",
        description="a batch with no trajectories, or none with a sampled token within max_seq_length: 'raise' "
        "NothingToTrainError (the step does not advance, nothing is written); 'skip' records a skipped step "
        "in the history, still without a new checkpoint. Groups with equal rewards are not 'nothing': their "
        "step advances without an update",
    )
    # ART 0.5.23's TrainConfig fields: accepted, so ART code constructs; resolve_train_config says which do nothing
    kl_penalty_source: Literal["current_learner", "sample"] = Field(
        default="current_learner",
        description="ART: which logprobs its KL-shaped advantages compare with the reference. The KL here is a "
        "k3 loss term on the learner's own logprobs ('current_learner'); 'sample' is reported as ignored",
    )
    grad_accumulation_sequences: int | None = Field(
        default=None,
        ge=1,
        description="ART: packed sequences per optimizer step, so one ART train call may take several. A "
        "train call here is one optimizer step over the whole batch (micro_batch_tokens only splits it for "
        "memory), so a value is reported as ignored",
    )
    optimizer_save_interval: int = Field(
        default=5,
        ge=1,
        description="ART: save the optimizer state every N steps. Here optimizer.pt is written with every "
        "checkpoint (a failed step or a restart resumes with AdamW's moments), so other values are reported "
        "as ignored",
    )
    final_training_step: int | None = Field(
        default=None,
        ge=1,
        description="ART: the run's last step, at which its backends save the optimizer state whatever "
        "optimizer_save_interval says. Every step here saves it and is served when train() returns, so there "
        "is nothing left to do at the last step: accepted silently",
    )

    @model_validator(mode="before")
    @classmethod
    def _one_name_for_kl(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "beta" in data and "kl_penalty_coef" in data:
            raise ValueError("pass kl_penalty_coef or beta (its ART 0.3-0.4 name), not both")
        return data

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

    def loss_settings(self) -> LossSettings:
        """What `grpo.policy_loss` takes from this config, epsilons resolved."""
        from .grpo import LossSettings  # torch: not at `import artnb`

        epsilon, epsilon_high = self.resolved_epsilons()
        return LossSettings(
            epsilon=epsilon,
            epsilon_high=epsilon_high,
            loss_fn=self.loss_fn,
            importance_sampling_level=self.importance_sampling_level,
            max_negative_advantage_importance_sampling_weight=self.max_negative_advantage_importance_sampling_weight,
            mask_prob_ratio=self.mask_prob_ratio,
            kimi_k2_tau=self.kimi_k2_tau,
            kl_penalty_coef=self.kl_penalty_coef,
            truncated_importance_sampling=self.truncated_importance_sampling,
        )


# ART keywords that set a TrainConfig field under another name: keyword -> the fields its value sets.
# normalize_advantages=True leaves scale_rewards alone, as in ART; ppo is dev.TrainConfig's flag for loss_fn.
_MAPPED: dict[str, Callable[[Any], dict[str, Any]]] = {
    "beta": lambda v: {"kl_penalty_coef": v},
    "normalize_advantages": lambda v: {} if v else {"scale_rewards": False},
    "ppo": lambda v: {"loss_fn": "ppo" if v else "cispo"},
}

_NO_REFERENCE_ADAPTER = "the KL reference is always the base model (the adapter switched off)"
_NO_MOE = "there is no mixture-of-experts routing replay here"
# ART keywords with no meaning here: keyword -> (values that ask for nothing artnb does not do anyway, why).
_IGNORED: dict[str, tuple[tuple[Any, ...], str]] = {
    "packed_sequence_length": (
        (None,),
        "sequences are not packed here; each micro-batch pads its rows (TrainConfig.micro_batch_tokens)",
    ),
    "megatron_topology": ((None,), "there is no Megatron trainer here"),
    "plot_tensors": ((False,), "there are no packed tensors to plot"),
    "save_checkpoint": (
        (True,),
        "every step commits its checkpoint (the engine serves it, and the step is a transaction around it); "
        "remove old ones with model.delete_checkpoints()",
    ),
    "kl_ref_adapter_path": ((None,), _NO_REFERENCE_ADAPTER),
    "kl_penalty_reference_step": ((None,), _NO_REFERENCE_ADAPTER),
    "kl_penalty_step_lag": ((None,), "a ServerlessBackend option"),
    "scale_learning_rate_by_reward_std_dev": (
        (False,),
        "it needs a regression over the run's reward history (ART's latest LocalBackend dropped it too)",
    ),
    "normalize_by_length": (
        (None, False),
        "the loss is a token mean over the whole batch, never per sequence",
    ),
    "moe_routing_replay_bundle": ((None,), _NO_MOE),
    "moe_routing_replay_path": ((None,), _NO_MOE),
    "moe_routing_replay_strict": ((None, True), _NO_MOE),
    "tinker_loss_fn": ((None,), "a TinkerBackend option"),
    "tinker_loss_fn_config": ((None,), "a TinkerBackend option"),
}
# ART's TrainConfig fields that change nothing here: field -> (does the resolved config ask for it?, why)
_INERT_FIELDS: dict[str, tuple[Callable[[TrainConfig], bool], str]] = {
    "kl_penalty_source": (
        lambda c: c.kl_penalty_source == "sample" and c.kl_penalty_coef > 0,
        "the KL here is a k3 loss term on the learner's own logprobs; 'sample' applies to ART's "
        "KL-shaped advantages",
    ),
    "grad_accumulation_sequences": (
        lambda c: c.grad_accumulation_sequences is not None,
        "a train call is one optimizer step over the whole batch; micro_batch_tokens splits it for memory only",
    ),
    "optimizer_save_interval": (
        lambda c: c.optimizer_save_interval != 5,
        "optimizer.pt is saved with every checkpoint",
    ),
}
# ART's LocalBackend raises unless these are None; so does artnb.
_MUST_BE_NONE = {
    "loss_fn_config": "the loss is chosen by loss_fn, epsilon and epsilon_high",
    "adam_params": "set learning_rate, weight_decay and max_grad_norm instead",
}


def resolve_train_config(
    config: TrainConfig | None, options: Mapping[str, Any], dev_config: Mapping[str, Any] | None = None
) -> TrainConfig:
    """The TrainConfig for one step: `config`'s explicitly set fields, overridden by `dev_config` (ART's
    `_config`, a `dev.TrainConfig` dict), overridden by `options` (keywords to `backend.train`).

    Each keyword is a TrainConfig field, an ART name for one (`beta` -> kl_penalty_coef, `normalize_advantages=
    False` -> scale_rewards=False, `ppo` -> loss_fn), or an ART knob with no meaning here: accepted, and if its
    value asks for something artnb does not do, reported once per process by name (so are ART's TrainConfig
    fields that change nothing here, `kl_penalty_source="sample"`, however they were given). `loss_fn_config` and
    `adam_params` must be None, as in ART's LocalBackend. Unknown names raise TypeError listing the valid ones.

    >>> resolve_train_config(TrainConfig(learning_rate=1e-4), {"beta": 0.05}, {"ppo": True}).loss_fn
    'ppo'
    """
    values = config.model_dump(exclude_unset=True) if config is not None else {}
    values.update(_fields_from(dev_config or {}, "_config"))
    values.update(_fields_from(options, "keyword"))
    resolved = TrainConfig(**values)
    for name, (asked, why) in _INERT_FIELDS.items():
        if asked(resolved):
            report_ignored(f"train({name}=...)", why)
    return resolved


def _fields_from(given: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The TrainConfig fields that the ART keywords in `given` set; ignored knobs are reported."""
    fields = set(TrainConfig.model_fields)
    unknown = sorted(set(given) - fields - set(_MAPPED) - set(_IGNORED) - set(_MUST_BE_NONE))
    if unknown:
        where = "training option(s)" if source == "keyword" else "_config key(s)"
        raise TypeError(
            f"unknown {where} {unknown}; valid options: {sorted(fields)}, and ART's "
            f"{sorted({*_MAPPED, *_IGNORED, *_MUST_BE_NONE})}"
        )
    out = {name: value for name, value in given.items() if name in fields}
    for name, value in given.items():
        if name in _MAPPED:
            for field, mapped in _MAPPED[name](value).items():
                if field in out and out[field] != mapped:
                    raise ValueError(
                        f"{name}={value!r} means {field}={mapped!r}, but {field}={out[field]!r} was given too"
                    )
                out[field] = mapped
        elif name in _MUST_BE_NONE and value is not None:
            raise ValueError(f"{name} must be None (as in ART's LocalBackend): {_MUST_BE_NONE[name]}")
        elif name in _IGNORED and value not in _IGNORED[name][0]:
            report_ignored(f"train({name}=...)", _IGNORED[name][1])
    return out


def low_memory_requested() -> bool:
    """`ARTNB_LOW_MEMORY=1` (Binder's ~2 GB pods): LocalBackend and the tutorials pick their small-memory settings."""
    return os.environ.get("ARTNB_LOW_MEMORY", "") not in ("", "0")


class TrainerConfig(_Strict):
    """How the trainer runs (device and memory trade-offs), fixed for the life of a backend."""

    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="'auto' picks cuda when available"
    )
    gradient_checkpointing: bool = Field(
        default=False, description="recompute activations in backward: ~40% less memory, ~30% slower"
    )
    seed: int = Field(default=0, description="seed for LoRA initialisation and dropout")
    share_prefixes: bool = Field(
        default=True,
        description="run the prompt that a micro-batch's sequences share (the system prompt, a group's "
        "scenario) once instead of once per sequence; the gradient is the same. Off: every row runs whole. "
        "Not with gradient_checkpointing, which turns off the key/value cache it needs",
    )
    placement: Literal["colocated", "split"] = Field(
        default="colocated",
        description="trainer='fsdp' only. 'colocated': every GPU serves, then every GPU trains while vLLM "
        "sleeps. 'split': the first half of the GPUs serve (vLLM stays awake), the other half train; needs "
        "at least 2 GPUs, and has no effect on a CPU",
    )
