"""UnslothTrainer: PeftTrainer's GRPO and SFT steps on a base model that Unsloth loads (CUDA only).

What Unsloth changes, and what stays PeftTrainer's:
- Loading: `FastLanguageModel.from_pretrained` (a 4-bit NF4 or 16-bit base with Unsloth's kernels patched in) and
  `FastLanguageModel.get_peft_model` (the LoRA adapter, and Unsloth's gradient checkpointing, which keeps each
  layer's input in CPU memory). The exact model named is loaded (`use_exact_model_name`), never a pre-quantised
  copy from the hub: the trainer trains the weights the engine serves.
- Logprobs: Unsloth's causal-LM forward ignores `logits_to_keep` given as positions (it returns every position's
  logits), so logprobs always go from the decoder's hidden states through the LM head, chunk by chunk (PeftTrainer's
  chunked path); a model whose logits are more than that (soft-capping) gets all its logits and then a selection.
- Precision: the forward runs under autocast in the card's dtype. A card without bf16 (T4) trains in fp16 with
  dynamic loss scaling (torch's GradScaler): the scale multiplies the gradient flowing back from the logprobs, which
  is the same as scaling the loss, so the loss itself stays PeftTrainer's.
- Checkpoints: the same three files as PeftTrainer (adapter_model.safetensors, adapter_config.json, optimizer.pt);
  adapter_config.json names the base model directory the engine serves, so either trainer resumes the other's
  checkpoints and vLLM loads them.
- Shared prompt prefixes are not run once per micro-batch (PeftTrainer's `share_prefixes`): that needs a forward
  with a key/value cache, which Unsloth routes to its inference kernels.
- Everything else (micro-batching, the GRPO loss, AdamW, SFT, the KL reference) is PeftTrainer's code.

`unsloth` is imported only when the trainer is built: it raises on a machine without an NVIDIA GPU, and it patches
transformers as it imports, so a script gets all of Unsloth's patches only by importing it before artnb (the
notebooks' setup cell does so on a GPU runtime).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import math
import subprocess
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ...core.config import LoRAConfig, TrainConfig, TrainerConfig
from .peft_trainer import ADAPTER_CONFIG, MicroBatch, PeftTrainer, present_target_modules

if TYPE_CHECKING:
    from ..gpu_presets import GPUPreset

INSTALL = "pip install 'artnb[gpu]' (vLLM, Unsloth and torch versions that work together)"
# fp16 only: the first loss scale; GradScaler halves it on each overflow and doubles it after 2000 clean steps
_INIT_LOSS_SCALE = 2.0**12


def unsloth_problem(*, try_import: bool = True) -> str | None:
    """None when Unsloth can train here; else why not, and the fix. Without CUDA or without the package it says
    so at once; otherwise `try_import` imports it in a subprocess (once per process, ~10 s), never in this one."""
    if "unsloth" in sys.modules:
        return None
    if not torch.cuda.is_available():
        return "Unsloth needs an NVIDIA GPU (CUDA) and this machine has none"
    if importlib.util.find_spec("unsloth") is None:
        return f"Unsloth is not installed: {INSTALL}"
    return _import_error() if try_import else None


@functools.cache
def _import_error() -> str | None:
    result = subprocess.run([sys.executable, "-c", "import unsloth"], capture_output=True, text=True)
    if result.returncode == 0:
        return None
    last = (result.stderr.strip().splitlines() or ["unknown error"])[-1]
    return f"`import unsloth` fails ({last}); reinstall the GPU stack: {INSTALL}"


class UnslothTrainer(PeftTrainer):
    """PeftTrainer with the base model and LoRA adapter from Unsloth; `preset` (a GPUPreset) says 4-bit or
    16-bit, the dtype and the longest sequence.

    Example (on a CUDA machine):
        >>> trainer = UnslothTrainer("Qwen/Qwen2.5-1.5B-Instruct", LoRAConfig(r=8), preset=preset)  # doctest: +SKIP
        >>> trainer.train(sequences, TrainConfig(learning_rate=1e-5))  # doctest: +SKIP
    """

    def __init__(
        self,
        base_model_path: str,
        lora: LoRAConfig | None = None,
        config: TrainerConfig | None = None,
        preset: GPUPreset | None = None,
    ) -> None:
        self.preset = preset
        self.base_model_path = str(base_model_path)
        super().__init__(base_model_path, lora, config)
        on_cuda = self.device.type == "cuda"
        self.dtype = _compute_dtype(preset) if on_cuda else torch.float32
        self._scaler = torch.amp.GradScaler(
            "cuda", init_scale=_INIT_LOSS_SCALE, enabled=on_cuda and self.dtype == torch.float16
        )

    def _load_model(self, base_model_path: str, lora: LoRAConfig, config: TrainerConfig):
        if self.device.type != "cuda":
            raise RuntimeError(
                "UnslothTrainer needs a CUDA GPU (TrainerConfig.device is 'cpu' or there is none): use PeftTrainer"
            )
        from unsloth import FastLanguageModel  # pyright: ignore[reportMissingImports]  # CUDA-only, not installed here

        from ..gpu_presets import model_shape

        preset = self.preset
        four_bit = bool(preset and preset.load_in_4bit)
        # "unsloth": checkpointed layer inputs kept in CPU memory; off only when the TrainerConfig says so
        explicit_off = (
            "gradient_checkpointing" in config.model_fields_set and not config.gradient_checkpointing
        )
        checkpointing = False if explicit_off else "unsloth"
        max_length = preset.max_seq_length if preset else model_shape(base_model_path).max_position_embeddings
        model, _tokenizer = FastLanguageModel.from_pretrained(
            model_name=base_model_path,
            max_seq_length=max_length,
            dtype=_compute_dtype(preset),
            load_in_4bit=four_bit,
            load_in_16bit=not four_bit,
            use_exact_model_name=True,
            use_gradient_checkpointing=checkpointing,
            random_state=config.seed,
            fast_inference=False,  # vLLM runs in its own server process (engines/vllm/server.py)
        )
        return FastLanguageModel.get_peft_model(
            model,
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=present_target_modules(model, lora.target_modules),
            bias="none",
            use_gradient_checkpointing=checkpointing,
            random_state=config.seed,
        )

    @property
    def max_seq_length(self) -> int:
        """The model's context length, or the preset's if shorter (Unsloth cuts inputs at what it was given)."""
        limit = super().max_seq_length
        return min(limit, self.preset.max_seq_length) if self.preset else limit

    # ----- checkpoints -------------------------------------------------------------------------------------

    def save_checkpoint(self, path: str | Path) -> None:
        """PeftTrainer's files, with adapter_config.json naming the base model directory that was loaded."""
        super().save_checkpoint(path)
        point_adapter_at_base(path, self.base_model_path)

    # ----- the parts that differ from PeftTrainer -----------------------------------------------------------

    def _logprobs(self, batch: MicroBatch, adapter: bool = True, chunk_size: int | None = None) -> Tensor:
        """[B, K] logprob of `batch.targets`, from the decoder's hidden states through the LM head (see the
        module docstring); without the adapter under no_grad (the reference model)."""
        if not adapter:
            with torch.no_grad(), self.model.disable_adapter():
                return self._logprobs(batch, chunk_size=chunk_size)
        inputs, keep = self._inputs(batch)
        with self._autocast():
            if self._can_chunk_logprobs():
                values = self._chunked_logprobs(
                    inputs, keep, batch, chunk_size or max(1, batch.targets.numel())
                )
            else:
                logits = self.model(**inputs).logits[:, keep]
                values = logits.float().log_softmax(-1).gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
        if self._scaler.is_enabled() and values.requires_grad:
            values.register_hook(self._scaler.scale)  # the gradient flowing back, times the loss scale
        return values

    def _shares_prefixes(self) -> bool:
        """Never: a forward with a key/value cache takes Unsloth's inference path (no gradients), and Unsloth's
        gradient checkpointing is on anyway."""
        return False

    def _apply_update(self, config: TrainConfig) -> float:
        """PeftTrainer's update; in fp16 the gradients are unscaled first, and an overflow skips the step and
        halves the loss scale."""
        if not self._scaler.is_enabled():
            return super()._apply_update(config)
        self._scaler.unscale_(self.optimizer)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm).item()
        scale = self._scaler.get_scale()
        self._scaler.step(self.optimizer)  # skipped when unscaling found inf or NaN
        self._scaler.update()
        if not math.isfinite(grad_norm):
            warnings.warn(
                f"artnb: fp16 gradients overflowed at loss scale {scale:g}; the update was skipped and the "
                "scale halved",
                stacklevel=3,
            )
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _autocast(self):
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return torch.autocast("cuda", dtype=self.dtype)


def point_adapter_at_base(path: str | Path, base_model_path: str) -> None:
    """Make `path`/adapter_config.json name `base_model_path` as its base model, as PeftTrainer's do: Unsloth
    records the name of the weights it loaded, which for a hub id can be a pre-quantised copy."""
    config_path = Path(path) / ADAPTER_CONFIG
    config = json.loads(config_path.read_text())
    if config.get("base_model_name_or_path") != base_model_path:
        config["base_model_name_or_path"] = base_model_path
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _compute_dtype(preset: GPUPreset | None) -> torch.dtype:
    """The preset's dtype; without one, bf16 where the card has it (Ampere and newer), else fp16."""
    if preset is not None:
        return getattr(torch, preset.dtype)
    return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
