"""What a registered model is set up with on this machine: its settings (the model's `_internal_config`, and on
CUDA the card's GPU preset) and its trainer with the tokenizer it tokenises with.

Kept apart from LocalBackend so that the order of precedence is written once: the GPU preset for the card and
model, overridden by `_internal_config`, overridden by what the backend was given explicitly.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Literal

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from ..core.config import TrainerConfig
from ..core.contracts import Trainer
from ..core.ignored import warn_user
from ..core.model import TrainableModel
from ..dev.settings import InternalSettings, resolve_internal_config
from .gpu_presets import GPUPreset
from .placement import FSDP_CONTROL_ENV, Placement, dedicated_placement, local_gpus, weight_bytes


def model_settings(
    model: TrainableModel, base_path: str, gpu_preset: GPUPreset | Literal["auto"] | None, *, on_cuda: bool
) -> InternalSettings:
    """The model's `_internal_config` applied to its LoRA shape and, on CUDA, to the card's GPU preset
    (`gpu_preset`: "auto" detects the card); the rest is used when the engine and trainer start."""
    settings = resolve_internal_config(model.internal_config, on_cuda=on_cuda)
    if settings.lora:
        model.lora = model.lora.model_copy(update=settings.lora)
    if on_cuda:
        settings.gpu_preset = _card_preset(model, base_path, gpu_preset, settings)
    elif isinstance(gpu_preset, GPUPreset):
        warn_user("artnb: LocalBackend(gpu_preset=...) has no effect here: this machine has no CUDA GPU")
    return settings


def _card_preset(
    model: TrainableModel,
    base_path: str,
    preset: GPUPreset | Literal["auto"] | None,
    settings: InternalSettings,
) -> GPUPreset | None:
    if preset == "auto":
        from .gpu_presets import preset_for

        try:
            preset = preset_for(base_path, lora_rank=model.lora.r)
        except (ValueError, OSError) as error:
            warn_user(
                f"artnb: no GPU preset for {model.base_model} ({error}); vLLM and the trainer keep their own "
                "defaults"
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


def apply_placement(
    settings: InternalSettings,
    requested: str,
    base_path: str,
    trainer_config: TrainerConfig,
    *,
    on_cuda: bool,
    gpus: tuple[int, int] | None = None,
) -> None:
    """Where vLLM and the trainer go on this machine's GPUs (placement.py), into `settings.placement`: the trainer
    is built with it (make_trainer prints it) and the engine started with it (engine_launch.py).

    Placed: the FSDP trainer (on a CPU too: its gloo ranks), and on CUDA ART's dedicated mode (`_internal_config`
    trainer_gpu_ids and inference_gpu_ids) with any trainer. `placement="split"` (from `trainer_config` or
    `_internal_config.trainer_args`) with another trainer is a ValueError, raised here, before the engine starts,
    as is a dedicated mode this machine cannot give. `gpus`: (count, bytes each) of another machine instead of
    this one's (what the placement would be on 8 H100s, seen from a laptop)."""
    from .trainers.choice import check_placement

    config = trainer_config_for(trainer_config, settings)
    setting = "TrainerConfig(placement='split')"
    if settings.trainer.get("placement") == "split":
        setting = "_internal_config.trainer_args.placement='split'"
    if settings.dedicated_gpus is None:
        check_placement(requested, config, setting)
    if settings.dedicated_gpus is not None and on_cuda:
        placement = _dedicated(settings, requested, base_path, gpus)
    elif requested == "fsdp":
        from .trainers.fsdp_trainer import local_placement

        placement = local_placement(base_path, config, gpus)
    else:
        return
    attached = os.environ.get(FSDP_CONTROL_ENV) if requested == "fsdp" else None
    if attached and not placement.colocated:
        raise ValueError(
            f"{placement}: but the FSDP trainer's ranks here were started by torchrun ({FSDP_CONTROL_ENV} is "
            "set, as on a multi-node cluster), on every GPU of each node, and vLLM would share them awake. Leave "
            "placement at 'colocated' and trainer_gpu_ids/inference_gpu_ids out (vLLM then sleeps while they step)"
        )
    settings.placement = dataclasses.replace(placement, attached=attached or None)


def _dedicated(
    settings: InternalSettings,
    requested: str,
    base_path: str,
    gpus: tuple[int, int] | None,
) -> Placement:
    assert settings.dedicated_gpus is not None
    train, serve = settings.dedicated_gpus
    in_process = requested != "fsdp"
    if in_process and len(train) > 1:
        warn_user(
            f"artnb: _internal_config trainer_gpu_ids={list(train)}: the {requested!r} trainer trains in this "
            "process, on GPU 0 alone; LocalBackend(trainer='fsdp') trains on all of them (a rank each)"
        )
    count, gpu_bytes = gpus or local_gpus()  # as in plan_placement, the GPUs are taken to be alike
    return dedicated_placement(
        train,
        serve,
        count,
        weight_bytes(base_path),
        gpu_bytes,
        in_process=in_process,
        engine_parallel=settings.engine_parallel,
    )


def trainer_config_for(trainer_config: TrainerConfig, settings: InternalSettings) -> TrainerConfig:
    """The backend's trainer config with the model's `_internal_config` trainer options over it."""
    return trainer_config.model_copy(update=settings.trainer)


def trainer_and_tokenizer(
    requested: str,
    base_path: str,
    model: TrainableModel,
    trainer_config: TrainerConfig,
    settings: InternalSettings,
    log_dir: Path | None = None,
) -> tuple[Trainer, PreTrainedTokenizerBase]:
    """The trainer `requested` ("auto", "peft", "unsloth", "fsdp") for the model, with `_internal_config`'s
    trainer options over `trainer_config`, and the base model's tokenizer (with `_internal_config`'s chat
    template, which the engine renders with too). `log_dir`: where a trainer that runs processes of its own (FSDP
    ranks) writes their logs: the run's logs folder."""
    from .trainers.choice import make_trainer

    config = trainer_config_for(trainer_config, settings)
    trainer = make_trainer(
        requested, base_path, model.lora, config, settings.gpu_preset, log_dir, settings.placement
    )
    return trainer, model_tokenizer(base_path, settings)


def model_tokenizer(base_path: str, settings: InternalSettings) -> PreTrainedTokenizerBase:
    """The base model's tokenizer, rendering with the chat template the model's engine was given, if any."""
    tokenizer = AutoTokenizer.from_pretrained(base_path)
    if settings.chat_template is not None:
        tokenizer.chat_template = settings.chat_template
    return tokenizer
