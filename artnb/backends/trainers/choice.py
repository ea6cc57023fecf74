"""Which trainer LocalBackend builds: "auto" (Unsloth on CUDA where it imports, else PEFT), "peft", "unsloth" or
"fsdp" (the PEFT step on N ranks with FSDP2, fsdp_trainer.py; asked for by name only). Only "fsdp" takes
`TrainerConfig(placement="split")` (`check_placement`).

The decision (`choose_trainer`) is a pure function of what was asked, whether CUDA is there and why Unsloth cannot
train (or None), so every message can be checked on any machine. Whether Unsloth imports is found out in a
subprocess (unsloth_trainer.py): a machine without a GPU never half-imports it. "auto" says once per process why
it chose what it chose: a warning when a GPU user gets PEFT instead of Unsloth, a log line otherwise.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from ...core.config import LoRAConfig, TrainerConfig
from ...core.ignored import warn_user

if TYPE_CHECKING:
    from ...core.contracts import Trainer
    from ..gpu_presets import GPUPreset
    from ..placement import Placement

log = logging.getLogger("artnb")

TrainerKind = Literal["auto", "peft", "unsloth", "fsdp"]
TRAINER_KINDS = ("auto", "peft", "unsloth", "fsdp")
_said: set[str] = set()


def choose_trainer(requested: str, *, on_cuda: bool, unsloth_problem: str | None) -> tuple[str, str]:
    """("peft", "unsloth" or "fsdp", why). `trainer="unsloth"` where Unsloth cannot train raises with the reason."""
    if requested not in TRAINER_KINDS:
        raise ValueError(f"trainer={requested!r}: choose 'auto', 'peft', 'unsloth' or 'fsdp'")
    if requested in ("peft", "fsdp"):
        return requested, f"trainer={requested!r} was asked for"
    if requested == "unsloth":
        if unsloth_problem is not None:
            raise RuntimeError(
                f"LocalBackend(trainer='unsloth'): {unsloth_problem}. Use trainer='peft' (or 'auto', which "
                "picks PEFT where Unsloth cannot run)"
            )
        return "unsloth", "trainer='unsloth' was asked for"
    if not on_cuda:
        return "peft", "trainer='auto' uses PEFT: this machine has no CUDA GPU, which Unsloth needs"
    if unsloth_problem is not None:
        return "peft", f"trainer='auto' uses PEFT, not Unsloth: {unsloth_problem}"
    return "unsloth", "trainer='auto' uses Unsloth: there is a CUDA GPU and `import unsloth` works"


def check_placement(
    requested: str, config: TrainerConfig, setting: str = "TrainerConfig(placement='split')"
) -> None:
    """A ValueError when `config` asks for the split placement and the trainer is not the FSDP trainer, the one
    that places its ranks (placement.py); `setting` names where the user asked for it."""
    if config.placement == "split" and requested != "fsdp":
        raise ValueError(
            f"{setting} gives half the GPUs to vLLM and half to the FSDP trainer's ranks, and trainer="
            f"{requested!r} is not the FSDP trainer: use LocalBackend(trainer='fsdp') for the split placement, or "
            "leave placement at 'colocated'"
        )


def make_trainer(
    requested: str,
    base_model_path: str,
    lora: LoRAConfig,
    config: TrainerConfig,
    preset: GPUPreset | None = None,
    log_dir: str | Path | None = None,
    placement: Placement | None = None,
) -> Trainer:
    """Build the trainer `requested` ("auto", "peft", "unsloth", "fsdp") for `base_model_path`, saying why once,
    and print where vLLM and the trainer go (`placement`, from model_setup.apply_placement; "fsdp" plans one for
    this machine when none is given)."""
    import torch

    from .unsloth_trainer import INSTALL, unsloth_problem

    on_cuda = config.device != "cpu" and torch.cuda.is_available()
    if requested == "fsdp" and placement is None:
        from .fsdp_trainer import local_placement

        placement = local_placement(base_model_path, config)
    if placement is not None:
        print(f"artnb: {placement}", flush=True)
    if requested == "fsdp":
        from .fsdp_trainer import FsdpTrainer

        assert placement is not None  # planned above
        if config.placement == "split" and not placement.serve_gpus:
            _say_once(
                "artnb: TrainerConfig(placement='split') has no effect here: this machine has no CUDA GPU (or "
                "device='cpu'), so the engine and the trainer's gloo ranks share the CPU",
                warn=True,
            )
        return FsdpTrainer(
            base_model_path,
            lora,
            config,
            log_dir=log_dir,
            placement=placement,  # a rank per training GPU, 2 on a CPU
        )
    problem = None if requested == "peft" else unsloth_problem()
    kind, why = choose_trainer(requested, on_cuda=on_cuda, unsloth_problem=problem)
    _say_once(f"artnb: {why}", warn=on_cuda and requested == "auto" and kind == "peft")
    if kind == "unsloth":
        from .unsloth_trainer import UnslothTrainer

        return UnslothTrainer(base_model_path, lora, config, preset)
    if preset is not None and preset.load_in_4bit:
        _say_once(
            f"artnb: the {preset.card} preset for this model (or init_args.load_in_4bit) loads the trainer's weights "
            "in 4 bits, which takes Unsloth; the PEFT trainer loads them in 16 bits and may run out of GPU memory. "
            f"Install Unsloth ({INSTALL}) or use a smaller model",
            warn=True,
        )
    from .peft_trainer import PeftTrainer

    if on_cuda and preset is not None:
        config = _peft_memory(base_model_path, config, preset)
    return PeftTrainer(base_model_path, lora, config)


def _peft_memory(base_model_path: str, config: TrainerConfig, preset: GPUPreset) -> TrainerConfig:
    """Gradient checkpointing for PEFT on a GPU when the preset's micro-batch would not fit without it.

    Presets size micro-batches for checkpointed activations (Unsloth always checkpoints); PEFT keeps every
    layer's activations unless told otherwise: 66 GiB for Qwen2.5-1.5B at 16384 tokens. A user's explicit
    `TrainerConfig(gradient_checkpointing=...)` is left as it is.
    """
    import torch

    from ..gpu_presets import model_shape, peft_needs_checkpointing

    if "gradient_checkpointing" in config.model_fields_set or config.gradient_checkpointing:
        return config
    free, _ = torch.cuda.mem_get_info()
    if not peft_needs_checkpointing(model_shape(base_model_path), preset.micro_batch_tokens, free):
        return config
    _say_once(
        f"artnb: the PEFT trainer recomputes activations (gradient checkpointing): {preset.micro_batch_tokens}-"
        f"token micro-batches would not fit in the {free / 2**30:.0f} GiB free otherwise. "
        "TrainerConfig(gradient_checkpointing=False) turns it off; a smaller TrainConfig.micro_batch_tokens "
        "then keeps memory down",
        warn=False,
    )
    return config.model_copy(update={"gradient_checkpointing": True})


def _say_once(message: str, *, warn: bool) -> None:
    if message in _said:
        return
    _said.add(message)
    if warn:
        warn_user(message)
    else:
        log.info(message)
