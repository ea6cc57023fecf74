"""artnb: train multi-step LLM agents with GRPO from a notebook. `import artnb as art`."""

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm must not reach the network at import

from dotenv import find_dotenv, load_dotenv  # noqa: E402

# As ART does: variables from a .env file (API keys) are loaded on import. Found from the working directory up
# (ART's default search starts at the package's own folder); variables already set are kept.
load_dotenv(find_dotenv(usecwd=True))

# The integrations (W&B, Trackio, Langfuse) register their reporters with core's registry (core/reporting.py) when
# imported, so every model reports to them; cheap: no tool's library is imported until a model asks for it.
from . import integrations  # noqa: E402, F401

# Every public name is imported on first use (PEP 562), so `import artnb` stays cheap and a process that needs one
# module (an engine server, a worker) does not import the whole package: name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "EngineDiedError": "backends.engine_transport",
    "LocalBackend": "backends.local",
    "DiskFullError": "backends.train_step",
    **dict.fromkeys(
        (
            "auto_trajectory",
            "capture_auto_trajectory",
            "capture_yielded_trajectory",
            "current_trajectory",
            "current_trajectory_group",
            "no_capture",
            "trajectory",
            "trajectory_group",
            "yield_trajectory",
        ),
        "core.capture",
    ),
    **dict.fromkeys(("RewardComparison", "compare_rewards"), "core.compare"),
    **dict.fromkeys(("LoRAConfig", "TrainConfig", "TrainerConfig"), "core.config"),
    **dict.fromkeys(
        (
            "compare_evaluation",
            "evaluate",
            "evaluate_greedy_and_sampled",
            "format_comparison",
            "paired_difference",
            "summarize_evaluation",
        ),
        "core.evaluate",
    ),
    **dict.fromkeys(("Interval", "bootstrap_mean"), "core.intervals"),
    "trajectory_group_batches": "core.batches",
    **dict.fromkeys(
        (
            "AfterEachFailure",
            "GatheredGroups",
            "TooManyExceptions",
            "gather_trajectories",
            "gather_trajectory_groups",
            "retry",
        ),
        "core.gather",
    ),
    **dict.fromkeys(("JudgeLimits", "JudgeRequestError", "RulerError"), "core.judge_requests"),
    "LocalJudge": "local_judge",
    **dict.fromkeys(("PreflightReport", "preflight", "preflight_groups"), "core.preflight"),
    **dict.fromkeys(("Model", "NothingToTrainError", "TrainableModel", "TrainResult"), "core.model"),
    **dict.fromkeys(("DEFAULT_RUBRIC", "ruler", "ruler_score_group"), "core.ruler"),
    "TrainSFTConfig": "core.sft",
    "LinearTemperatureAnnealer": "core.temperature",
    **dict.fromkeys(("PipelineAutotuneConfig", "PipelineRuntimeConfig"), "core.pipeline_config"),
    "MetricDefinition": "metrics",
    "RunInUseError": "core.store",
    **dict.fromkeys(
        ("History", "Messages", "MessagesAndChoices", "Tools", "Trajectory", "TrajectoryGroup"),
        "core.trajectory",
    ),
}
# Backends beyond this machine: reachable as attributes, left out of `from artnb import *`.
_BEYOND: dict[str, str] = {
    # Backend: ART 0.3-0.4's client of a backend server
    **dict.fromkeys(("RemoteBackend", "Backend", "ServerUnavailableError"), "backends.remote"),
    "SkyPilotBackend": "backends.skypilot",
    "ServerlessBackend": "serverless",
}
_ALIASES = {
    "LocalTrainResult": "TrainResult",  # ART's name for what LocalBackend.train returns
    "ServerlessTrainResult": "TrainResult",  # artnb's ServerlessBackend trains here: a TrainResult too
    # ART: its managed local inference became unreachable; here the engine process exited (it restarts)
    "LocalServingUnavailableError": "EngineDiedError",
}
# Submodules a user reaches as attributes: artnb's own and ART's module paths (`art.utils`, `art.rewards`...).
_MODULES = (
    "dev", "explain", "models", "tutorial", "widgets", "utils", "rewards", "local", "serverless", "skypilot", "types",
    "trajectories", "metrics", "integrations", "autorl", "openai", "pipeline_trainer",
)  # fmt: skip

# built from the lazy-export tables above, which pyright cannot follow
__all__ = sorted({*_EXPORTS, *_ALIASES, "dev", "explain", "models", "tutorial"})  # pyright: ignore[reportUnsupportedDunderAll]


def __getattr__(name: str):
    import importlib.util

    attribute = _ALIASES.get(name, name)
    if module := _EXPORTS.get(attribute) or _BEYOND.get(attribute):
        value = getattr(importlib.import_module(f".{module}", __name__), attribute)
    elif name in _MODULES or importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f".{name}", __name__)  # also artnb.core, artnb.tasks, ...
    else:
        raise AttributeError(f"module 'artnb' has no attribute {name!r}")
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    import pkgutil

    submodules = {m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")}
    return sorted({*globals(), *_EXPORTS, *_BEYOND, *_ALIASES, *_MODULES, *submodules})
