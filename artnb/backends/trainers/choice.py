"""Which trainer LocalBackend builds: "auto" (Unsloth on CUDA where it imports, else PEFT), "peft" or "unsloth".

The decision (`choose_trainer`) is a pure function of what was asked, whether CUDA is there and why Unsloth cannot
train (or None), so every message can be checked on any machine. Whether Unsloth imports is found out in a
subprocess (unsloth_trainer.py): a machine without a GPU never half-imports it. "auto" says once per process why
it chose what it chose: a warning when a GPU user gets PEFT instead of Unsloth, a log line otherwise.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Literal

from ...core.config import LoRAConfig, TrainerConfig
from ...core.ignored import warn_user

if TYPE_CHECKING:
    from ...core.contracts import Trainer
    from ..gpu_presets import GPUPreset

log = logging.getLogger("artnb")

TrainerKind = Literal["auto", "peft", "unsloth"]
TRAINER_KINDS = ("auto", "peft", "unsloth")
_said: set[str] = set()


def choose_trainer(requested: str, *, on_cuda: bool, unsloth_problem: str | None) -> tuple[str, str]:
    """("peft" or "unsloth", why). `trainer="unsloth"` where Unsloth cannot train raises with the reason."""
    if requested not in TRAINER_KINDS:
        raise ValueError(f"trainer={requested!r}: choose 'auto', 'peft' or 'unsloth'")
    if requested == "peft":
        return "peft", "trainer='peft' was asked for"
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


def make_trainer(
    requested: str,
    base_model_path: str,
    lora: LoRAConfig,
    config: TrainerConfig,
    preset: GPUPreset | None = None,
) -> Trainer:
    """Build the trainer `requested` ("auto", "peft", "unsloth") for `base_model_path`, saying why once."""
    import torch

    from .unsloth_trainer import INSTALL, unsloth_problem

    on_cuda = config.device != "cpu" and torch.cuda.is_available()
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

    return PeftTrainer(base_model_path, lora, config)


def _say_once(message: str, *, warn: bool) -> None:
    if message in _said:
        return
    _said.add(message)
    if warn:
        warn_user(message)
    else:
        log.info(message)
