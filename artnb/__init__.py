"""artnb: train multi-step LLM agents with GRPO from a notebook. `import artnb as art`."""

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm must not reach the network at import

from dotenv import find_dotenv, load_dotenv  # noqa: E402

# As ART does: variables from a .env file (API keys) are loaded on import. Found from the working directory up
# (ART's default search starts at the package's own folder); variables already set are kept.
load_dotenv(find_dotenv(usecwd=True))

from . import dev, explain, models, tutorial  # noqa: E402
from .backends.local import EngineDiedError, LocalBackend  # noqa: E402
from .core.compare import RewardComparison, compare_rewards  # noqa: E402
from .core.config import LoRAConfig, TrainConfig, TrainerConfig  # noqa: E402
from .core.evaluate import evaluate, summarize_evaluation  # noqa: E402
from .core.gather import (  # noqa: E402
    AfterEachFailure,
    GatheredGroups,
    TooManyExceptions,
    gather_trajectories,
    gather_trajectory_groups,
    retry,
)
from .core.judge_requests import JudgeLimits, JudgeRequestError, RulerError  # noqa: E402
from .core.local_judge import LocalJudge as LocalJudge  # noqa: E402 (exported)
from .core.model import Model, NothingToTrainError, TrainableModel, TrainResult  # noqa: E402
from .core.ruler import DEFAULT_RUBRIC, ruler, ruler_score_group  # noqa: E402
from .core.sft import TrainSFTConfig  # noqa: E402
from .core.store import RunInUseError  # noqa: E402
from .core.trajectory import (  # noqa: E402
    History,
    Messages,
    MessagesAndChoices,
    Tools,
    Trajectory,
    TrajectoryGroup,
)

LocalTrainResult = TrainResult  # ART's name for what LocalBackend.train returns

__all__ = [
    "AfterEachFailure",
    "DEFAULT_RUBRIC",
    "EngineDiedError",
    "GatheredGroups",
    "History",
    "JudgeLimits",
    "JudgeRequestError",
    "LoRAConfig",
    "LocalBackend",
    "LocalTrainResult",
    "Messages",
    "MessagesAndChoices",
    "Model",
    "NothingToTrainError",
    "RewardComparison",
    "RulerError",
    "RunInUseError",
    "TooManyExceptions",
    "Tools",
    "TrainConfig",
    "TrainResult",
    "TrainSFTConfig",
    "TrainableModel",
    "TrainerConfig",
    "Trajectory",
    "TrajectoryGroup",
    "compare_rewards",
    "dev",
    "evaluate",
    "explain",
    "gather_trajectories",
    "gather_trajectory_groups",
    "models",
    "retry",
    "ruler",
    "ruler_score_group",
    "summarize_evaluation",
    "tutorial",
]


# Imported on first use: `art.widgets` (ipywidgets, plotly) and ART's module paths (`art.utils`, `art.rewards`...).
_LAZY_MODULES = {
    "widgets", "utils", "rewards", "local", "serverless", "skypilot", "types", "trajectories", "metrics", "integrations",
    "autorl",
}  # fmt: skip
# Backends beyond this machine, imported on first use: name -> module.
_LAZY_CLASSES = {
    "RemoteBackend": "backends.remote",
    "Backend": "backends.remote",  # ART 0.3-0.4's client of a backend server
    "ServerUnavailableError": "backends.remote",
    "SkyPilotBackend": "backends.skypilot",
    "ServerlessBackend": "serverless",
}


def __getattr__(name: str):
    if name in _LAZY_MODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    if name in _LAZY_CLASSES:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY_CLASSES[name]}", __name__), name)
    raise AttributeError(f"module 'artnb' has no attribute {name!r}")
