"""Every ART name artnb supports, where ART users import it from, and how artnb provides it.

One row per usage in ART's published notebooks and examples that artnb supports: (module, name, status, note).
status: "same" (same call, same meaning), "mapped" (same call, artnb's equivalent behind it), "accepted" (accepted
for compatibility, reported once as having no effect here). The import-surface test walks this list; the
closing note's table is printed from it (`python tests/compat/art_surface.py`).
"""

from __future__ import annotations

SURFACE: list[tuple[str, str, str, str]] = [
    # top level
    ("artnb", "Trajectory", "same", ""),
    ("artnb", "TrajectoryGroup", "same", "exceptions=[raw exception] accepted"),
    (
        "artnb",
        "Model",
        "same",
        "generic over its config: art.Model[MyConfig]; register(backend) for comparison models",
    ),
    ("artnb", "TrainableModel", "same", "_internal_config=, lora_config=, config= accepted"),
    ("artnb", "gather_trajectory_groups", "same", "pbar_desc, max_exceptions, after_each, max_metrics"),
    ("artnb", "gather_trajectories", "same", ""),
    ("artnb", "retry", "same", ""),
    ("artnb", "TrainConfig", "same", "learning_rate, beta (= kl_penalty_coef)"),
    ("artnb", "TrainResult", "same", "step, metrics, checkpoint_path"),
    ("artnb", "LocalTrainResult", "same", ""),
    ("artnb", "LocalBackend", "same", "also at the top level (ART lists it but never imports it)"),
    (
        "artnb",
        "ServerlessBackend",
        "mapped",
        "trains on this machine (a LocalBackend); W&B Serverless is unreachable",
    ),
    ("artnb", "trajectory", "same", "the rollout may also return its reward or its own Trajectory"),
    ("artnb", "trajectory_group", "same", "return_exceptions= keeps failures in group.exceptions"),
    ("artnb", "current_trajectory", "same", ""),
    ("artnb", "current_trajectory_group", "same", ""),
    ("artnb", "no_capture", "same", "RULER's judge requests are never captured"),
    ("artnb", "yield_trajectory", "same", ""),
    ("artnb", "capture_yielded_trajectory", "same", ""),
    ("artnb", "auto_trajectory", "same", "deprecated, as in ART"),
    ("artnb", "capture_auto_trajectory", "same", "deprecated, as in ART"),
    ("artnb", "Messages", "same", ""),
    ("artnb", "MessagesAndChoices", "same", ""),
    ("artnb", "Tools", "same", ""),
    ("artnb", "LoRAConfig", "same", "r or rank, alpha, dropout, target_modules"),
    ("artnb", "dev", "same", ""),
    (
        "artnb",
        "TrainSFTConfig",
        "same",
        "learning_rate (a value or one per batch), batch_size, assistant_turns",
    ),
    (
        "artnb",
        "LinearTemperatureAnnealer",
        "mapped",
        "model.set_temperature_annealer(...): the engine's default temperature moves at each train, no restart",
    ),
    # module paths
    (
        "artnb.langgraph",
        "init_chat_model",
        "mapped",
        "a plain ChatOpenAI on the policy; calls captured over HTTP",
    ),
    ("artnb.langgraph", "wrap_rollout", "mapped", "trains the sampled token ids, not re-tokenised messages"),
    (
        "artnb.mcp",
        "generate_scenarios",
        "mapped",
        "AutoRL's generator; generator_model may be an art.Model (offline)",
    ),
    ("artnb.mcp", "preview_scenarios", "same", ""),
    (
        "artnb.mcp.generate_scenarios",
        "preview_scenarios",
        "same",
        "ART's MCP·RL notebook imports it from here",
    ),
    ("artnb.mcp", "MCPTool", "same", ""),
    ("artnb.mcp", "MCPResource", "same", ""),
    (
        "artnb.mcp.types",
        "GeneratedScenarioCollection",
        "same",
        "shuffle(seed=) leaves the global random alone",
    ),
    ("artnb", "trajectory_group_batches", "same", "lazy; failure budget per batch"),
    ("artnb.pipeline_trainer", "PipelineTrainer", "mapped", "records lag and ratio spread per step; plots="),
    ("artnb.pipeline_trainer", "make_group_rollout_fn", "same", ""),
    ("artnb.metrics", "track_api_cost", "same", ""),
    ("artnb.metrics", "MetricsBuilder", "mapped", "measure, add_data, add_idle_times; no .../cum/ totals"),
    ("artnb.local", "LocalBackend", "same", ""),
    ("artnb.local.backend", "LocalBackend", "same", ""),
    ("artnb.serverless", "ServerlessBackend", "mapped", ""),
    ("artnb.serverless.backend", "ServerlessBackend", "mapped", ""),
    ("artnb.rewards", "ruler_score_group", "same", "with judge time limits and retries of its own"),
    ("artnb.rewards", "ruler", "same", ""),
    ("artnb.types", "Messages", "same", ""),
    ("artnb.types", "MessagesAndChoices", "same", ""),
    ("artnb.types", "Tools", "same", ""),
    ("artnb.types", "TrainConfig", "same", ""),
    ("artnb.trajectories", "Trajectory", "same", ""),
    ("artnb.trajectories", "TrajectoryGroup", "same", ""),
    ("artnb.trajectories", "History", "same", ""),
    ("artnb.trajectories", "LegacyHistory", "same", "ART's later name for History (additional_histories)"),
    ("artnb.trajectories", "PydanticException", "same", ""),
    # art.dev
    ("artnb.dev", "InternalModelConfig", "mapped", "see artnb/dev/settings.py"),
    ("artnb.dev", "InitArgs", "mapped", "max_seq_length, use_gradient_checkpointing, random_state honoured"),
    ("artnb.dev", "EngineArgs", "mapped", "vLLM flags passed on; GPU-only ones reported on a CPU"),
    ("artnb.dev", "PeftArgs", "mapped", "r, lora_alpha, lora_dropout, target_modules"),
    ("artnb.dev", "LoRAConfig", "mapped", "rank, alpha, dropout, target_modules"),
    ("artnb.dev", "TrainerArgs", "mapped", "gradient_checkpointing, seed; the rest reported"),
    ("artnb.dev", "TrainConfig", "mapped", "model.train(groups, _config=...)"),
    ("artnb.dev", "OpenAIServerConfig", "accepted", "artnb's engines choose host, port, key, parsers"),
    # art.utils
    (
        "artnb.utils",
        "iterate_dataset",
        "same",
        "batches unpack as ART 0.3-0.4 tuples and have ART 0.5's attributes",
    ),
    ("artnb.utils", "limit_concurrency", "same", ""),
    ("artnb.utils", "strip_logprobs", "same", ""),
    ("artnb.utils.strip_logprobs", "strip_logprobs", "same", ""),
    ("artnb.utils.litellm", "convert_litellm_choice_to_openai", "same", ""),
    ("artnb.utils.output_dirs", "get_output_dir_from_model_properties", "same", "computed by RunStore"),
    ("artnb.utils.benchmarking.load_trajectories", "load_trajectories", "mapped", "pandas, not polars"),
    ("artnb.utils.benchmarking.charts", "training_progress_chart", "mapped", "plotly, not matplotlib"),
    (
        "artnb.utils.benchmarking.charts",
        "percentage_comparison_bar_chart",
        "mapped",
        "plotly, not matplotlib",
    ),
    ("artnb.utils.benchmarking.types", "BenchmarkModelKey", "same", ""),
    ("artnb.utils.logging", "info", "same", ""),
    (
        "artnb.utils.get_trajectory_messages",
        "get_trajectory_messages",
        "same",
        "Trajectory.messages(); keeps an assistant turn's tool calls (ART keeps its text only)",
    ),
    (
        "artnb.utils.get_repo_root_path",
        "get_repo_root_path",
        "mapped",
        "the working directory's git repository",
    ),
    ("artnb.utils.benchmark_rollout", "benchmark_rollout", "same", ""),
    ("artnb.utils.s3", "pull_model_from_s3", "mapped", "LocalBackend's pull: boto3, whole steps, no AWS CLI"),
    ("artnb.guided_completion", "get_guided_completion_params", "same", "both engines honour the params"),
    ("artnb.gather", "GatherContext", "same", "a bar the caller makes, running means, exception budget"),
    ("artnb.gather", "set_gather_context", "same", ""),
    ("artnb.gather", "wrap_group_awaitable", "same", "a group or any sequence of trajectories"),
    (
        "artnb.utils.sft",
        "train_sft_from_file",
        "same",
        "assistant_turns honoured; whole file checked before training (shuffle_buffer_size reported)",
    ),
    ("artnb.utils.sft", "create_sft_dataset_iterator", "same", ""),
    ("artnb.types", "TrainSFTConfig", "same", ""),
]


if __name__ == "__main__":
    print("| ART name | status | note |\n|---|---|---|")
    for module, name, status, note in SURFACE:
        print(f"| `{module.replace('artnb', 'art', 1)}.{name}` | {status} | {note} |")
