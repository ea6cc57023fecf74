"""Which inference engine serves a model, built with which options, and started: LocalBackend's `engine=` and
`engine_options=` turned into a running Engine.

"auto" is vLLM when it imports, else the HF engine; when vLLM imports but cannot serve the model (vLLM's CPU
kernels refuse a tiny test model, say) "auto" warns with vLLM's reason and starts the HF engine. The options a
model's engine gets are layered: the card's GPU preset, then the model's `_internal_config`, then the backend's
`engine_options` (the last of a vLLM flag wins); a placement on GPUs (placement.py) comes after the preset and
gives vLLM, or the HF engine, its serving GPUs. An option the chosen engine does not take is a TypeError naming
the ones it does. The chat template and its default variables come from `_internal_config` alone: the trainer
renders with them too, so an engine given others in `engine_options` would sample from prompts unlike the ones
trained on (a ValueError naming the `_internal_config` key instead).
"""

from __future__ import annotations

import asyncio
import inspect
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from ..core.contracts import Engine
from ..core.ignored import warn_user
from ..core.model import TrainableModel
from ..core.store import RunStore
from ..dev.settings import InternalSettings

EngineKind = Literal["auto", "vllm", "hf"]
ENGINE_KINDS = ("auto", "vllm", "hf")


@dataclass
class EngineLauncher:
    """Starts engines of the `requested` kind with `options` (LocalBackend's `engine` and `engine_options`)."""

    requested: EngineKind = "auto"
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.requested not in ENGINE_KINDS:
            raise ValueError(f"engine={self.requested!r}: choose 'auto', 'vllm' or 'hf'")

    async def start(
        self, base_path: str, model: TrainableModel, store: RunStore, settings: InternalSettings
    ) -> Engine:
        """Start the model's engine; "auto" falls back to the HF engine when vLLM cannot serve the model."""
        kind = await self._kind()
        engine = self.make(kind, base_path, model, store, settings)
        try:
            await _started(engine)
        except RuntimeError as error:
            if self.requested != "auto" or kind != "vllm":
                raise
            warn_user(
                f"artnb: {error}\nUsing the HF engine instead; pass LocalBackend(engine='hf') to skip trying vLLM."
            )
            engine = self.make("hf", base_path, model, store, settings)
            await _started(engine)
        return engine

    async def _kind(self) -> str:
        if self.requested != "auto":
            return self.requested
        from .engines.vllm.client import vllm_import_error

        return "vllm" if await asyncio.to_thread(vllm_import_error) is None else "hf"

    def make(
        self, kind: str, base_path: str, model: TrainableModel, store: RunStore, settings: InternalSettings
    ) -> Engine:
        """The `kind` engine for the model, built (not started) with its layered options."""
        options = {**self.options, **chat_template_options(self.options, settings)}
        settings.report_for_engine(kind)
        placement = settings.placement  # on GPUs: which serve (model_setup.apply_placement)
        if kind == "vllm":
            from .engines.vllm.client import VLLMEngine, vllm_import_error

            if (problem := vllm_import_error()) is not None:
                raise RuntimeError(f"LocalBackend(engine='vllm'): {problem}. Or use engine='hf'.")
            options.setdefault("max_lora_rank", max(model.lora.r, settings.max_lora_rank or 0))
            preset = settings.gpu_preset.vllm_args() if settings.gpu_preset else []
            placed: list[str] = []
            if placement is not None and placement.serve_gpus:
                placed = placement.vllm_args()
                # split: only the serving GPUs (engine_options' env wins)
                serving = placement.vllm_env(os.environ.get("CUDA_VISIBLE_DEVICES"))
                options["env"] = {**serving, **(options.get("env") or {})}
            options["extra_args"] = [*preset, *placed, *settings.vllm_args, *options.get("extra_args", [])]
            options = options_for(VLLMEngine, options, "vllm")
            return VLLMEngine(base_path, served_name=model.base_model, log_dir=store.logs, **options)
        from .engines.hf.client import HFEngine

        if on_cuda():  # a GPU decodes 64 rows for about the price of 32 (engine_options may say otherwise)
            options.setdefault("max_batch_size", 64)
        if placement is not None and placement.serve_gpus and not placement.colocated:
            options.setdefault("device", f"cuda:{placement.serve_gpus[0]}")  # its first serving GPU
        options = options_for(HFEngine, options, "hf")
        return HFEngine(base_path, served_name=model.base_model, log_dir=store.logs, **options)


# (engine option, vLLM flag, the _internal_config key that sets them)
_TEMPLATE_SETTINGS = (
    ("chat_template", "--chat-template", "chat_template"),
    ("default_chat_template_kwargs", "--default-chat-template-kwargs", "chat_template_kwargs"),
)


def chat_template_options(options: dict[str, Any], settings: InternalSettings) -> dict[str, Any]:
    """The engine options that give it the model's chat template and default template variables (both engines
    take the same two); a ValueError when `options` (LocalBackend's engine_options) set them otherwise."""
    flags = {str(arg).split("=")[0] for arg in options.get("extra_args") or []}
    for option, flag, key in _TEMPLATE_SETTINGS:
        if option in options:
            raise ValueError(_template_elsewhere(f"engine_options[{option!r}]", key))
        if flag in flags:
            raise ValueError(_template_elsewhere(f"engine_options extra_args {flag}", key))
    return {
        "chat_template": settings.chat_template,
        "default_chat_template_kwargs": settings.chat_template_kwargs,
    }


def _template_elsewhere(where: str, key: str) -> str:
    return (
        f"{where}: pass it as the model's _internal_config[{key!r}] instead, so that the trainer renders the "
        "conversations it trains on as the engine rendered them when sampling"
    )


def options_for(engine_class: type, options: dict[str, Any], kind: str) -> dict[str, Any]:
    """`options` if `engine_class` takes them all; else a TypeError naming the ones it does not take."""
    accepted = set(inspect.signature(engine_class.__init__).parameters) - {
        "self", "model_path", "served_name", "log_dir"
    }  # fmt: skip
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise TypeError(
            f"engine_options {unknown} are not options of the {kind} engine ({engine_class.__name__}); "
            f"it takes {sorted(accepted)}"
        )
    return options


def on_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


async def _started(engine: Engine) -> Engine:
    """`engine.start()`; a start that fails or is interrupted (the notebook's stop button) stops the server it
    launched, which would otherwise serve on, unowned, until the kernel exits (a re-run would start another)."""
    try:
        await engine.start()
    except BaseException:
        stopping = asyncio.ensure_future(engine.stop())
        await asyncio.shield(stopping)  # interrupted again, it goes on stopping in the background
        raise
    return engine
