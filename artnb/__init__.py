"""artnb: train multi-step LLM agents with GRPO from a notebook. `import artnb as art`."""

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm must not reach the network at import

from . import models, tutorial  # noqa: E402
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
from .core.model import Model, NothingToTrainError, TrainableModel, TrainResult  # noqa: E402
from .core.ruler import DEFAULT_RUBRIC, ruler, ruler_score_group  # noqa: E402
from .core.store import RunInUseError  # noqa: E402
from .core.trajectory import History, Trajectory, TrajectoryGroup  # noqa: E402

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
    "Model",
    "NothingToTrainError",
    "RewardComparison",
    "RulerError",
    "RunInUseError",
    "TooManyExceptions",
    "TrainConfig",
    "TrainResult",
    "TrainableModel",
    "TrainerConfig",
    "Trajectory",
    "TrajectoryGroup",
    "compare_rewards",
    "evaluate",
    "gather_trajectories",
    "gather_trajectory_groups",
    "models",
    "retry",
    "ruler",
    "ruler_score_group",
    "summarize_evaluation",
    "tutorial",
]


def __getattr__(name: str):
    # `art.widgets` is imported on first use, so `import artnb` stays free of ipywidgets and plotly.
    if name == "widgets":
        import importlib

        return importlib.import_module(".widgets", __name__)
    raise AttributeError(f"module 'artnb' has no attribute {name!r}")
