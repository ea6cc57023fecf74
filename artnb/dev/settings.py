"""What ART's `_internal_config` means in artnb: which keys are honoured, mapped or ignored, decided in one place.

`resolve_internal_config` turns the dict into `InternalSettings`, which LocalBackend applies: the LoRA shape, the
trainer's options, the longest sequence trained, vLLM command-line flags (used when vLLM serves; the HF engine has
no such knobs) and, on CUDA, changes to the card's GPU preset (backends/gpu_presets.py): `max_seq_length`,
`gpu_memory_utilization`, `load_in_4bit` (Unsloth's 4-bit loading) and `enforce_eager` override the preset's.
`chat_template` (or `chat_template_path`) and `chat_template_kwargs` are given to both engines as server-side
defaults (so every client, not only `model.openai_client()`, gets them) and to the trainer's tokenisation, so what
is trained is rendered as what was sampled. Keys with no meaning here (GPU-only settings on a CPU, flags vLLM no
longer has, `chat_template_content_format`) are accepted and reported once each by `report_ignored`. A near miss of
a key ART lists in full (the top level, `init_args`, LoRA's: `max_seq_len`) is an error with the nearest names (in
engine_args and trainer_args, whose options are vLLM's and TRL's, it is said in the warning), and so is a value of
the wrong type or range, named as it was written (`_internal_config["init_args"]["max_seq_length"]`). ART's
dedicated mode (`trainer_gpu_ids` with `inference_gpu_ids`) is checked here on any machine and placed on CUDA by
backends/model_setup.py (backends/placement.py says how).
"""

from __future__ import annotations

import json
import numbers
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.config import (
    TrainerConfig,
    art_lora_fields,
    check_internal_config,
    unknown_art_key,
)
from ..core.ignored import report_ignored
from ..core.names import nearest

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
# the types artnb checks before turning a value into a vLLM flag (the rest are strings, passed as given)
_BOOL_FLAGS = {"enforce_eager", "enable_prefix_caching", "enable_chunked_prefill", "trust_remote_code"}
_BOOL_FLAGS |= {"disable_log_stats"}
_POSITIVE_INT_FLAGS = {
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "max_logprobs",
}
_POSITIVE_INT_FLAGS |= {"tensor_parallel_size", "pipeline_parallel_size"}

# What ART's dev config types name, in every ART version artnb follows (0.3's torchtune_args to the latest
# lora_config and vllm_runtime). A key that is a near miss of one of these (or of an engine or trainer setting
# artnb passes on) is a typo: an error with the nearest names. Any other key is accepted and reported once as
# ignored, so that ART code written for a newer ART, or passing Unsloth's, vLLM's or TRL's own options, runs.
ART_CONFIG_KEYS = frozenset(
    """init_args engine_args peft_args lora_config trainer_args torchtune_args _decouple_vllm_and_unsloth
    tinker_args tinker_native_args trainer_gpu_ids inference_gpu_ids rollout_weights_mode
    rollout_weight_update_mode chat_template_kwargs chat_template chat_template_path chat_template_content_format
    chat_template_tool_schema_format vllm_runtime allow_unvalidated_arch megatron_model_initialization""".split()
)
ART_INIT_ARGS = frozenset(
    """model_name max_seq_length dtype load_in_4bit load_in_8bit load_in_16bit full_finetuning token device_map
    rope_scaling fix_tokenizer trust_remote_code use_gradient_checkpointing resize_model_vocab revision
    use_exact_model_name fast_inference gpu_memory_utilization float8_kv_cache random_state max_lora_rank
    disable_log_stats enable_prefix_caching use_async load_in_fp8""".split()
)
_HONOURED = {
    "_internal_config": [
        *("init_args", "engine_args", "lora_config", "peft_args", "trainer_args"),
        *("chat_template_kwargs", "chat_template", "chat_template_path"),
    ],
    "init_args": ["max_seq_length", "use_gradient_checkpointing", "random_state", "max_lora_rank"],
    "trainer_args": ["gradient_checkpointing", "seed", "placement"],
}
# apply_chat_template's own arguments (and the template's `messages`), which the engines and the trainer set
# per call: as chat_template_kwargs they would clash with those or silently change every rendering.
_RENDER_ARGUMENTS = frozenset(
    """conversation messages tools documents chat_template add_generation_prompt continue_final_message tokenize
    padding truncation max_length return_tensors return_dict return_assistant_tokens_mask tokenizer_kwargs""".split()
)
# TrainConfig.max_seq_length's own bound: a shorter limit leaves no room for a prompt and a reply
MIN_SEQ_LENGTH = 16


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
    # The chat template both engines and the trainer render with (None: the tokenizer's own), and the keyword
    # arguments they render with by default (a request's own chat_template_kwargs override them in the engine).
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def report_for_engine(self, kind: str) -> None:
        """The HF engine has none of vLLM's knobs: report the flags it will not use."""
        if kind != "vllm" and self.vllm_args:
            flags = " ".join(a for a in self.vllm_args if a.startswith("--"))
            report_ignored(
                "_internal_config.engine_args", f"the HF engine serves this model ({flags} are vLLM's)"
            )


def resolve_internal_config(config: Mapping[str, Any] | None, *, on_cuda: bool) -> InternalSettings:
    """The settings `config` (an `art.dev.InternalModelConfig` dict) asks for, reporting what has no effect.

    Bad input is refused here, at register, before anything loads: a key neither artnb nor ART knows (with the
    nearest names), a section that is not a dict, a value of the wrong type or range (naming where it was given).
    """
    out = InternalSettings()
    config = check_internal_config(config)
    if not config:
        return out
    for key in config:
        _known_key("", key, ART_CONFIG_KEYS, _HONOURED["_internal_config"])
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
            _init_args(_section(key, value), out, on_cuda)
        elif key == "engine_args":
            _engine_args(_section(key, value), out, on_cuda)
        elif key in ("peft_args", "lora_config"):
            out.lora.update(art_lora_fields(f"_internal_config.{key}", _section(key, value)))
        elif key == "trainer_args":
            _trainer_args(_section(key, value), out)
        elif key == "chat_template_kwargs":
            out.chat_template_kwargs = _template_kwargs(value)
        elif key in ("chat_template", "chat_template_path"):
            continue  # read together, below: they are two spellings of one setting
        else:
            report_ignored(f"_internal_config.{key}", "artnb has no such setting")
    out.chat_template = _chat_template(config.get("chat_template"), config.get("chat_template_path"))
    if out.max_seq_length and "--max-model-len" not in out.vllm_args:
        out.vllm_args += ["--max-model-len", str(out.max_seq_length)]
    return out


def _template_kwargs(value: object) -> dict[str, Any]:
    """`_internal_config["chat_template_kwargs"]` checked: template variables by name, each JSON-serialisable,
    since vLLM takes them as JSON on its command line and the HF engine the same way."""
    where = '_internal_config["chat_template_kwargs"]'
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{where} must be a dict of template variables (got {type(value).__name__} {value!r:.60}); pass "
            'e.g. {"enable_thinking": False}'
        )
    kwargs = dict(value)
    if bad := [k for k in kwargs if not isinstance(k, str)]:
        raise TypeError(f"{where}: keys must be strings, the template variables' names (got {bad[0]!r})")
    if clash := sorted(_RENDER_ARGUMENTS & kwargs.keys()):
        hint = ' (pass the template as _internal_config["chat_template"])' if "chat_template" in clash else ""
        raise ValueError(
            f"{where}[{json.dumps(clash[0])}]: that is an argument of apply_chat_template itself, which artnb sets for "
            f"each rendering; chat_template_kwargs are the template's own variables{hint}"
        )
    for key, item in kwargs.items():
        try:
            json.dumps(item, allow_nan=False)
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"{where}[{json.dumps(key)}] = {item!r:.60} is not JSON-serialisable ({error}); the engines get these "
                "as JSON: use strings, numbers, booleans, None, lists and dicts"
            ) from error
    return kwargs


def _chat_template(text: object, path: object) -> str | None:
    """The chat template text from `_internal_config["chat_template"]` or the file at `chat_template_path`
    (read now, at register, so the engines and the trainer render with the same text even if the file changes)."""
    if text is not None and path is not None:
        raise ValueError(
            '_internal_config has both "chat_template" and "chat_template_path": pass one (the template text, '
            "or the path of a file holding it)"
        )
    if path is not None:
        text = _read_template(path)
    elif text is not None and not isinstance(text, str):
        raise TypeError(
            f'_internal_config["chat_template"] must be the template text, a str (got {type(text).__name__}); '
            'for a file, pass _internal_config["chat_template_path"]'
        )
    if text is not None and not text.strip():
        raise ValueError(
            "_internal_config's chat template is empty; leave chat_template and chat_template_path out for the "
            "model's own template"
        )
    if text is not None:
        _check_template_syntax(text, "chat_template_path" if path is not None else "chat_template")
    return text


def _check_template_syntax(text: str, key: str) -> None:
    """A template that does not parse is refused at register, not at the first request or step. Compiled as
    transformers compiles chat templates (its extensions, e.g. `{% generation %}`, included)."""
    try:
        from jinja2 import TemplateSyntaxError
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError:  # a transformers without it: the engines report the error at the first rendering
        return
    try:  # rendering compiles the template first
        render_jinja_template([[{"role": "user", "content": "Hi"}]], chat_template=text)
    except TemplateSyntaxError as error:
        raise ValueError(
            f'_internal_config["{key}"]: the chat template does not parse (jinja2, line {error.lineno}: '
            f"{error.message}); fix it, or leave {key} out for the model's own template"
        ) from None
    except (
        Exception
    ):  # it parsed; what it raises for this one probe (e.g. "a system turn first") is its own rule
        return


def template_read_here(config: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """`config` (an `_internal_config`) with `chat_template_path` replaced by the file's text, read on this
    machine: a model registered on a remote server names a file of the notebook's, not of the server's."""
    if not config or config.get("chat_template_path") is None:
        return config
    text = _chat_template(config.get("chat_template"), config["chat_template_path"])
    return {**{k: v for k, v in config.items() if k != "chat_template_path"}, "chat_template": text}


def _read_template(path: object) -> str:
    where = f'_internal_config["chat_template_path"]={path!r}'
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"{where}: pass the path of a chat template file, as a str or a Path")
    try:
        return Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(
            f"{where} could not be read ({type(error).__name__}: {error}); pass the path of a readable "
            "UTF-8 file holding the template (e.g. a model's chat_template.jinja)"
        ) from error


def _section(key: str, value: object) -> Mapping[str, Any]:
    """The dict under `_internal_config[key]` (None: an empty one); a TypeError naming the key otherwise."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        example = {
            "init_args": "art.dev.InitArgs(max_seq_length=8192)",
            "engine_args": "art.dev.EngineArgs(enforce_eager=True)",
            "trainer_args": "art.dev.TrainerArgs(seed=1)",
        }.get(key, "{...}")
        raise TypeError(
            f'_internal_config["{key}"] must be a dict (got {type(value).__name__} {value!r:.60}); pass e.g. '
            f"{key}={example}"
        )
    return value


def _flag(where: str, value: object) -> bool:
    """`value` if it is a bool: bool("false") is True, so a string here would silently mean the opposite."""
    if not isinstance(value, bool):
        raise TypeError(
            f"{where} must be True or False (got {value!r}); pass the bool, not a string or a number"
        )
    return value


def _as_int(value: object) -> int | None:
    """`value` as an int if it is a whole number (8192, 8e3), else None: not a bool, a string or 4.5."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _whole(where: str, value: object, minimum: int | None = None) -> int:
    """`value` if it is a whole number (not a bool, not "8") and at least `minimum`; a TypeError/ValueError
    otherwise."""
    wanted = f"{where} must be a whole number" + (f" >= {minimum}" if minimum is not None else "")
    number = _as_int(value)
    if number is None:
        raise TypeError(f"{wanted} (got {value!r}); pass an int")
    if minimum is not None and number < minimum:
        raise ValueError(f"{wanted} (got {value!r}); pass an int of at least {minimum}")
    return number


def _seq_length(where: str, value: object) -> int:
    """The longest sequence, trained and served: a whole number of tokens, at least TrainConfig's bound."""
    wanted = f"{where} must be a whole number of tokens >= {MIN_SEQ_LENGTH} (got {value!r}); pass e.g. 4096"
    number = _as_int(value)
    if number is None:
        raise TypeError(wanted)
    if number < MIN_SEQ_LENGTH:
        raise ValueError(f"{wanted}, or leave it out for the model's context length")
    return number


def _memory_fraction(where: str, value: object) -> float:
    """A share of GPU memory, as vLLM takes it: a number in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where} must be a fraction of GPU memory in (0, 1] (got {value!r}); pass e.g. 0.8")
    if not 0 < float(value) <= 1:
        raise ValueError(f"{where} must be a fraction of GPU memory in (0, 1] (got {value!r}); pass e.g. 0.8")
    return float(value)


def _gradient_checkpointing(where: str, value: object) -> bool:
    """Unsloth's setting: True, False or "unsloth" (its offloading variant, here plain checkpointing)."""
    if value == "unsloth" or isinstance(value, bool):
        return value is True or value == "unsloth"
    raise ValueError(
        f'{where} must be True, False or "unsloth" (got {value!r}); pass the bool False (not the string "false") '
        "to turn checkpointing off"
    )


def _known_key(section: str, key: str, known: Iterable[str], honoured: Iterable[str]) -> bool:
    """Whether `key` is one of `known`. A near miss of one is an error naming it (a typo would otherwise be
    reported as ignored, and the setting silently not applied); any other key is False, for the caller to
    report as ignored. For the sections whose keys ART lists in full (the top level, init_args)."""
    if key in known:
        return True
    if nearest(key, known, cutoff=0.8):  # (load_in_fp8, a real Unsloth option, is 0.78 from load_in_8bit)
        raise unknown_art_key(f"_internal_config.{section}".rstrip("."), key, known, honoured)
    return False


def _did_you_mean(key: str, honoured: Iterable[str]) -> str:
    """For engine_args and trainer_args, which go on to vLLM and TRL in ART and take their many options: a key
    near one artnb uses may be a typo, or an option of its own (gradient_checkpointing_kwargs), so it is said,
    not refused."""
    close = nearest(key, honoured, cutoff=0.75)
    return f" (if you meant {' or '.join(map(repr, close))}, fix the spelling)" if close else ""


def _init_args(args: Mapping[str, Any], out: InternalSettings, on_cuda: bool) -> None:
    for key, value in args.items():
        _known_key("init_args", key, ART_INIT_ARGS, _HONOURED["init_args"])
        where = f'_internal_config["init_args"]["{key}"]'
        if key == "max_seq_length":
            out.max_seq_length = out.gpu_overrides["max_seq_length"] = _seq_length(where, value)
        elif key == "load_in_4bit":
            load_in_4bit = _flag(where, value)
            if on_cuda:
                out.gpu_overrides["load_in_4bit"] = load_in_4bit
            else:
                report_ignored(
                    "_internal_config.init_args.load_in_4bit", "Unsloth's 4-bit loading needs a GPU"
                )
        elif key == "use_gradient_checkpointing":
            out.trainer["gradient_checkpointing"] = _gradient_checkpointing(where, value)
        elif key == "random_state":
            out.trainer["seed"] = _whole(where, value)
        elif key == "max_lora_rank":
            out.max_lora_rank = _whole(where, value, minimum=1)
        elif key in ("gpu_memory_utilization", "enable_prefix_caching"):
            _engine_args({key: value}, out, on_cuda, section="init_args")
        else:
            report_ignored(
                f"_internal_config.init_args.{key}",
                "artnb's trainers load the model named by base_model in the card's dtype (fp32 on the CPU); on "
                "CUDA load_in_4bit selects Unsloth's 4-bit loading",
            )


def _engine_value(where: str, key: str, value: Any) -> Any:
    """`value` checked for the vLLM flag `key` (None: vLLM's default), so a typo fails here, not in vLLM."""
    if value is None:
        return None
    if key == "gpu_memory_utilization":
        return _memory_fraction(where, value)
    if key in _BOOL_FLAGS:
        return _flag(where, value)
    if key == "max_logprobs" and value == -1:
        return -1  # vLLM: no cap
    if key in _POSITIVE_INT_FLAGS:
        return _whole(where, value, minimum=1)
    return value


def _engine_args(
    args: Mapping[str, Any], out: InternalSettings, on_cuda: bool, section: str = "engine_args"
) -> None:
    for key, value in args.items():
        if key not in VLLM_FLAGS:
            report_ignored(
                f"_internal_config.{section}.{key}",
                "not one of the vLLM settings artnb passes on" + _did_you_mean(key, VLLM_FLAGS),
            )
            continue
        value = _engine_value(f'_internal_config["{section}"]["{key}"]', key, value)
        flag, cuda_only = VLLM_FLAGS[key]
        if on_cuda and value is not None and key in ("tensor_parallel_size", "pipeline_parallel_size"):
            sizes = out.engine_parallel or (1, 1)
            out.engine_parallel = (value, sizes[1]) if key == "tensor_parallel_size" else (sizes[0], value)
        if cuda_only and not on_cuda:
            report_ignored(f"_internal_config.{section}.{key}", "a GPU setting, and this machine has no GPU")
        elif value is None:
            continue
        elif isinstance(value, bool):
            out.vllm_args.append(flag if value else "--no-" + flag[2:])
        else:
            out.vllm_args += [flag, str(value)]
        if on_cuda and value is not None and key in _PRESET_FIELDS:
            out.gpu_overrides[key] = _PRESET_FIELDS[key](value)


def _trainer_args(args: Mapping[str, Any], out: InternalSettings) -> None:
    for key, value in args.items():
        where = f'_internal_config["trainer_args"]["{key}"]'
        if key == "gradient_checkpointing":
            out.trainer["gradient_checkpointing"] = _flag(where, value)
        elif key == "seed":
            out.trainer["seed"] = _whole(where, value)
        elif key == "placement":  # artnb's own TrainerConfig.placement, validated here
            out.trainer["placement"] = TrainerConfig(placement=value).placement
        else:
            report_ignored(
                f"_internal_config.trainer_args.{key}",
                "artnb's trainer takes its training options from backend.train(...) / TrainConfig"
                + _did_you_mean(key, _HONOURED["trainer_args"]),
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
