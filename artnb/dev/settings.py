"""What ART's `_internal_config` means in artnb: which keys are honoured, mapped or ignored, decided in one place.

`resolve_internal_config` turns the dict into `InternalSettings`, which LocalBackend applies: the LoRA shape, the
trainer's options, the longest sequence trained, vLLM command-line flags (used when vLLM serves; the HF engine
has no such knobs) and, on CUDA, changes to the card's GPU preset (backends/gpu_presets.py): `max_seq_length`,
`gpu_memory_utilization`, `load_in_4bit` (Unsloth's 4-bit loading) and `enforce_eager` override the preset's. Keys
with no meaning here (GPU-only settings on a CPU, flags vLLM no longer has) are accepted and reported once each by
`report_ignored`. ART's dedicated mode (`trainer_gpu_ids` with `inference_gpu_ids`) is checked here on any machine
and placed on CUDA by backends/model_setup.py (backends/placement.py says how).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..core.config import TrainerConfig, art_lora_fields
from ..core.ignored import report_ignored

if TYPE_CHECKING:
    from ..backends.gpu_presets import GPUPreset
    from ..backends.placement import Placement

# ART EngineArgs key -> (vLLM flag, needs CUDA). Boolean values become `--flag` / `--no-flag`.
VLLM_FLAGS: dict[str, tuple[str, bool]] = {
    "max_model_len": ("--max-model-len", False),
    "enforce_eager": ("--enforce-eager", False),
    "max_num_seqs": ("--max-num-seqs", False),
    "max_num_batched_tokens": ("--max-num-batched-tokens", False),
    "enable_prefix_caching": ("--enable-prefix-caching", False),
    "enable_chunked_prefill": ("--enable-chunked-prefill", False),
    "seed": ("--seed", False),
    "block_size": ("--block-size", False),
    "trust_remote_code": ("--trust-remote-code", False),
    "disable_log_stats": ("--disable-log-stats", False),
    "max_logprobs": ("--max-logprobs", False),
    "gpu_memory_utilization": ("--gpu-memory-utilization", True),
    "tensor_parallel_size": ("--tensor-parallel-size", True),
    "pipeline_parallel_size": ("--pipeline-parallel-size", True),
    "swap_space": ("--swap-space", True),
    "cpu_offload_gb": ("--cpu-offload-gb", True),
    "kv_cache_dtype": ("--kv-cache-dtype", True),
    "quantization": ("--quantization", True),
    "dtype": ("--dtype", True),  # on the CPU artnb serves fp32 (bf16 is far slower there)
}
# engine_args that are also GPUPreset fields (the preset's values are vLLM's flags too)
_PRESET_FIELDS = {"gpu_memory_utilization": float, "enforce_eager": bool}


@dataclass
class InternalSettings:
    """What an `_internal_config` changes, in artnb's terms."""

    max_seq_length: int | None = None  # longest sequence trained and served (vLLM --max-model-len)
    lora: dict[str, Any] = field(default_factory=dict)  # LoRAConfig fields
    trainer: dict[str, Any] = field(default_factory=dict)  # TrainerConfig fields
    max_lora_rank: int | None = None
    vllm_args: list[str] = field(default_factory=list)  # vLLM flags, before the user's engine_options
    gpu_overrides: dict[str, Any] = field(default_factory=dict)  # GPUPreset fields (on CUDA)
    gpu_preset: GPUPreset | None = None  # the card's preset with gpu_overrides applied; set by LocalBackend
    # ART's dedicated mode: (trainer_gpu_ids, inference_gpu_ids), on CUDA
    dedicated_gpus: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    engine_parallel: tuple[int, int] | None = None  # engine_args' (tensor, pipeline) parallel sizes, if given
    placement: Placement | None = None  # where vLLM and the trainer go on the GPUs; set by LocalBackend

    def report_for_engine(self, kind: str) -> None:
        """The HF engine has none of vLLM's knobs: report the flags it will not use."""
        if kind != "vllm" and self.vllm_args:
            flags = " ".join(a for a in self.vllm_args if a.startswith("--"))
            report_ignored(
                "_internal_config.engine_args", f"the HF engine serves this model ({flags} are vLLM's)"
            )


def resolve_internal_config(config: Mapping[str, Any] | None, *, on_cuda: bool) -> InternalSettings:
    """The settings `config` (an `art.dev.InternalModelConfig` dict) asks for, reporting what has no effect."""
    out = InternalSettings()
    if not config:
        return out
    if not isinstance(config, Mapping):
        raise TypeError(
            f"_internal_config must be an art.dev.InternalModelConfig(...) dict, got {type(config).__name__}"
        )
    dedicated = check_dedicated_gpus(config.get("trainer_gpu_ids"), config.get("inference_gpu_ids"))
    engine_args = config.get("engine_args")
    if dedicated and isinstance(engine_args, Mapping) and engine_args.get("enable_sleep_mode"):
        raise ValueError(
            "_internal_config engine_args.enable_sleep_mode=True with trainer_gpu_ids and inference_gpu_ids: in "
            "dedicated mode vLLM has its GPUs to itself and never sleeps; leave enable_sleep_mode out"
        )
    if dedicated and on_cuda:
        out.dedicated_gpus = dedicated
    elif dedicated:
        report_ignored(
            "_internal_config.trainer_gpu_ids and inference_gpu_ids",
            "GPU settings, and this machine has no GPU: the engine and the trainer share the CPU",
        )
    for key, value in config.items():
        if key in ("trainer_gpu_ids", "inference_gpu_ids"):
            continue
        if key == "init_args":
            _init_args(value or {}, out, on_cuda)
        elif key == "engine_args":
            _engine_args(value or {}, out, on_cuda)
        elif key in ("peft_args", "lora_config"):
            _lora(key, value or {}, out)
        elif key == "trainer_args":
            _trainer_args(value or {}, out)
        else:
            report_ignored(f"_internal_config.{key}", "artnb has no such setting")
    if out.max_seq_length and "--max-model-len" not in out.vllm_args:
        out.vllm_args += ["--max-model-len", str(out.max_seq_length)]
    return out


def _init_args(args: Mapping[str, Any], out: InternalSettings, on_cuda: bool) -> None:
    for key, value in args.items():
        if key == "max_seq_length":
            out.max_seq_length = out.gpu_overrides["max_seq_length"] = int(value)
        elif key == "load_in_4bit":
            if on_cuda:
                out.gpu_overrides["load_in_4bit"] = bool(value)
            else:
                report_ignored(
                    "_internal_config.init_args.load_in_4bit", "Unsloth's 4-bit loading needs a GPU"
                )
        elif key == "use_gradient_checkpointing":
            out.trainer["gradient_checkpointing"] = bool(value)
        elif key == "random_state":
            out.trainer["seed"] = int(value)
        elif key == "max_lora_rank":
            out.max_lora_rank = int(value)
        elif key in ("gpu_memory_utilization", "enable_prefix_caching"):
            _engine_args({key: value}, out, on_cuda)
        else:
            report_ignored(
                f"_internal_config.init_args.{key}",
                "artnb's trainers load the model named by base_model in the card's dtype (fp32 on the CPU); on "
                "CUDA load_in_4bit selects Unsloth's 4-bit loading",
            )


def _engine_args(args: Mapping[str, Any], out: InternalSettings, on_cuda: bool) -> None:
    for key, value in args.items():
        if key not in VLLM_FLAGS:
            report_ignored(
                f"_internal_config.engine_args.{key}", "not one of the vLLM settings artnb passes on"
            )
            continue
        flag, cuda_only = VLLM_FLAGS[key]
        if on_cuda and value is not None and key in ("tensor_parallel_size", "pipeline_parallel_size"):
            sizes = out.engine_parallel or (1, 1)
            size = int(value)
            out.engine_parallel = (size, sizes[1]) if key == "tensor_parallel_size" else (sizes[0], size)
        if cuda_only and not on_cuda:
            report_ignored(
                f"_internal_config.engine_args.{key}", "a GPU setting, and this machine has no GPU"
            )
        elif value is None:
            continue
        elif isinstance(value, bool):
            out.vllm_args.append(flag if value else "--no-" + flag[2:])
        else:
            out.vllm_args += [flag, str(value)]
        if on_cuda and value is not None and key in _PRESET_FIELDS:
            out.gpu_overrides[key] = _PRESET_FIELDS[key](value)


def _lora(section: str, args: Mapping[str, Any], out: InternalSettings) -> None:
    out.lora.update(art_lora_fields(section, args))


def _trainer_args(args: Mapping[str, Any], out: InternalSettings) -> None:
    for key, value in args.items():
        if key == "gradient_checkpointing":
            out.trainer["gradient_checkpointing"] = bool(value)
        elif key == "seed":
            out.trainer["seed"] = int(value)
        elif key == "placement":  # artnb's own TrainerConfig.placement, validated here
            out.trainer["placement"] = TrainerConfig(placement=value).placement
        else:
            report_ignored(
                f"_internal_config.trainer_args.{key}",
                "artnb's trainer takes its training options from backend.train(...) / TrainConfig",
            )


def check_dedicated_gpus(
    trainer_gpu_ids: object, inference_gpu_ids: object
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """ART's `trainer_gpu_ids` and `inference_gpu_ids` (both or neither: None), as (train, serve); a ValueError
    naming the fix for any other shape. No GPU is needed to check them.

    >>> check_dedicated_gpus([0], [1, 2])
    ((0,), (1, 2))
    """
    if trainer_gpu_ids is None and inference_gpu_ids is None:
        return None
    said = f"_internal_config trainer_gpu_ids={trainer_gpu_ids!r}, inference_gpu_ids={inference_gpu_ids!r}"
    if trainer_gpu_ids is None or inference_gpu_ids is None:
        raise ValueError(
            f"{said}: ART's dedicated mode needs both (e.g. trainer_gpu_ids=[0], inference_gpu_ids=[1]); leave "
            "both out for the shared mode, where vLLM sleeps while the trainer steps"
        )
    ids: list[tuple[int, ...]] = []
    for name, value in (("trainer_gpu_ids", trainer_gpu_ids), ("inference_gpu_ids", inference_gpu_ids)):
        if (
            not isinstance(value, list | tuple)
            or not value
            or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in value)
            or len(set(value)) != len(value)
        ):
            raise ValueError(f"{said}: {name} must be a non-empty list of distinct GPU numbers (ints >= 0)")
        ids.append(tuple(value))
    if shared := sorted(set(ids[0]) & set(ids[1])):
        raise ValueError(
            f"{said}: GPU {shared[0]} is in both; dedicated mode gives each GPU one role. To share GPUs (vLLM "
            "sleeping while the trainer steps), leave both out"
        )
    return ids[0], ids[1]
