"""`art.dev`: ART's "internal" configuration types, accepted as ART's notebooks write them.

These are plain dicts (TypedDicts), as in ART: `art.dev.InternalModelConfig(init_args=art.dev.InitArgs(
max_seq_length=8192), engine_args=art.dev.EngineArgs(enforce_eager=True, gpu_memory_utilization=0.8))`, assigned
to `model._internal_config` or passed as `TrainableModel(..., _internal_config=...)`. What each key means here,
and which keys have no meaning on this machine (reported once by name), is decided in `settings.py`; unlisted keys
are accepted by the types (as in ART) and reported there too. `dev.TrainConfig` is the dict form of
`backend.train(...)`'s keywords (`model.train(groups, _config=...)`).
"""

from __future__ import annotations

from typing import Any, Literal

from typing_extensions import TypedDict

from .settings import InternalSettings, resolve_internal_config


class InitArgs(TypedDict, total=False):
    """How ART (Unsloth) loads the model. Honoured: max_seq_length, use_gradient_checkpointing, random_state,
    max_lora_rank; on CUDA also gpu_memory_utilization (vLLM) and load_in_4bit (the Unsloth trainer), which
    override the card's GPU preset."""

    model_name: str
    max_seq_length: int
    dtype: str | None
    load_in_4bit: bool
    load_in_8bit: bool
    load_in_16bit: bool
    full_finetuning: bool
    fast_inference: bool
    gpu_memory_utilization: float
    max_lora_rank: int
    use_gradient_checkpointing: str | bool
    random_state: int
    enable_prefix_caching: bool


class EngineArgs(TypedDict, total=False):
    """vLLM engine arguments; the ones artnb passes to vLLM are listed in settings.VLLM_FLAGS."""

    max_model_len: int | None
    enforce_eager: bool | None
    gpu_memory_utilization: float
    tensor_parallel_size: int
    pipeline_parallel_size: int
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    enable_prefix_caching: bool | None
    enable_chunked_prefill: bool | None
    swap_space: float
    cpu_offload_gb: float
    kv_cache_dtype: str
    quantization: str | None
    dtype: str
    seed: int
    block_size: int | None
    trust_remote_code: bool
    disable_log_stats: bool
    max_logprobs: int
    num_scheduler_steps: int


class PeftArgs(TypedDict, total=False):
    """ART 0.3–0.4's LoRA settings (PEFT names): r, lora_alpha, lora_dropout, target_modules are honoured."""

    r: int
    lora_alpha: int
    lora_dropout: float
    target_modules: list[str]
    bias: str
    use_rslora: bool
    use_gradient_checkpointing: str | bool
    random_state: int


class LoRAConfig(TypedDict, total=False):
    """ART 0.5's LoRA settings (`TrainableModel(lora_config=...)`): rank, alpha, dropout, target_modules."""

    rank: int
    alpha: int
    dropout: float
    target_modules: list[str]
    bias: str
    use_rslora: bool


class TrainerArgs(TypedDict, total=False):
    """ART's trainer (TRL/transformers TrainingArguments) settings. Honoured: gradient_checkpointing, seed; and
    artnb's own `placement` (TrainerConfig.placement: "split" for LocalBackend(trainer="fsdp"))."""

    gradient_checkpointing: bool
    seed: int
    placement: Literal["colocated", "split"]
    learning_rate: float
    weight_decay: float
    max_grad_norm: float
    per_device_train_batch_size: int
    gradient_accumulation_steps: int


class InternalModelConfig(TypedDict, total=False):
    """`trainer_gpu_ids` with `inference_gpu_ids` is ART's dedicated mode: the trainer on the first GPUs, vLLM awake
    on the others (e.g. [0] and [1]); artnb also lets LocalBackend(trainer="fsdp")'s ranks take any GPUs."""

    init_args: InitArgs
    engine_args: EngineArgs
    peft_args: PeftArgs
    trainer_args: TrainerArgs
    torchtune_args: dict[str, Any]
    chat_template_kwargs: dict[str, Any]  # the template's variables, e.g. {"enable_thinking": False}
    chat_template: str  # template text; or chat_template_path: a file holding it (engines and trainer use it)
    chat_template_path: str
    trainer_gpu_ids: list[int]
    inference_gpu_ids: list[int]


class TrainConfig(TypedDict, total=False):
    """The keywords of `backend.train(model, groups, **kwargs)` as a dict (`model.train(groups, _config=...)`)."""

    learning_rate: float
    beta: float
    kl_penalty_coef: float
    epsilon: float
    epsilon_high: float
    scale_rewards: bool
    normalize_advantages: bool
    importance_sampling_level: Literal["token", "sequence", "average", "geometric_average"]
    logprob_calculation_chunk_size: int
    precalculate_logprobs: bool
    max_negative_advantage_importance_sampling_weight: float
    truncated_importance_sampling: float | None
    allow_training_without_logprobs: bool
    loss_fn: Literal["cispo", "ppo"]
    ppo: bool
    mask_prob_ratio: bool
    kimi_k2_tau: float | None
    advantage_balance: float
    num_trajectories_learning_rate_multiplier_power: float
    verbose: bool


class ServerArgs(TypedDict, total=False):
    """vLLM OpenAI-server arguments; artnb's engines choose their own host, port, key and parsers."""

    tool_call_parser: str | None
    enable_auto_tool_choice: bool
    chat_template: str | None


class OpenAIServerConfig(TypedDict, total=False):
    """`model.register(backend, _openai_client_config=...)`: its engine_args join the model's
    `_internal_config["engine_args"]`; server_args and log_file are reported as ignored."""

    log_file: str
    server_args: ServerArgs
    engine_args: EngineArgs


class SFTMetricLoggingConfig(TypedDict, total=False):
    """ART's `_config["metric_logging"]` of train_sft: accepted; every SFT step records its metrics here."""

    enabled: bool
    target_training_step: int


class TrainSFTConfig(TypedDict, total=False):
    """`model.train_sft(trajectories, _config=...)` as a dict: the fields of `art.TrainSFTConfig` (whose
    docs say what each does), and ART's `metric_logging`."""

    learning_rate: float | list[float]
    batch_size: int | Literal["auto"]
    assistant_turns: Literal["all", "last"]
    max_seq_length: int | None
    max_grad_norm: float
    weight_decay: float
    micro_batch_tokens: int
    metric_logging: SFTMetricLoggingConfig


class VllmRuntimeArgs(TypedDict, total=False):
    """ART's `_internal_config["vllm_runtime"]` (an external vLLM server for ART to drive): accepted and
    reported as ignored, since artnb's LocalBackend always starts and manages its own engine."""

    mode: Literal["managed", "external"]
    server_url: str
    api_key: str | None
    local_checkpoint_root: str | None
    server_checkpoint_root: str | None
    health_timeout_s: float


def get_openai_server_config(
    model_name: str,
    base_model: str,
    log_file: str,
    lora_path: str | None = None,
    config: OpenAIServerConfig | None = None,
) -> OpenAIServerConfig:
    """ART's builder of its vLLM server's config, for `model.register(backend, _openai_client_config=...)`:
    `config`'s own settings, with `log_file` unless `config` names one.

    ART also fills in the served model names, the LoRA module of `lora_path` and its tool parser; artnb's
    engines decide those themselves (a model is served as `name` and `name@step`), so they are left out:
    what the result carries is what you set. `model_name`, `base_model` and `lora_path` are checked to be
    what ART takes (names and a path, as text)."""
    for label, value in (("model_name", model_name), ("base_model", base_model), ("log_file", log_file)):
        if not isinstance(value, str) or not value:
            raise TypeError(f"get_openai_server_config: {label} takes a non-empty string (got {value!r:.60})")
    if lora_path is not None and not isinstance(lora_path, str):
        raise TypeError(
            f"get_openai_server_config: lora_path takes a path string or None (got {lora_path!r:.60})"
        )
    given: OpenAIServerConfig = config or OpenAIServerConfig()
    out = OpenAIServerConfig(log_file=given.get("log_file", log_file))
    if "server_args" in given:
        out["server_args"] = ServerArgs(**given["server_args"])
    if "engine_args" in given:
        out["engine_args"] = EngineArgs(**given["engine_args"])
    return out


__all__ = [
    "EngineArgs",
    "InitArgs",
    "InternalModelConfig",
    "InternalSettings",
    "LoRAConfig",
    "OpenAIServerConfig",
    "PeftArgs",
    "SFTMetricLoggingConfig",
    "ServerArgs",
    "TrainConfig",
    "TrainSFTConfig",
    "TrainerArgs",
    "VllmRuntimeArgs",
    "get_openai_server_config",
    "resolve_internal_config",
]
