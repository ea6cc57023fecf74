"""artnb: train multi-step LLM agents with GRPO from a notebook. `import artnb as art`."""

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm must not reach the network at import

from . import models  # noqa: E402
from .backends.local import EngineDiedError, LocalBackend  # noqa: E402
from .core.config import LoRAConfig, TrainConfig, TrainerConfig  # noqa: E402
from .core.gather import (  # noqa: E402
    TooManyExceptions,
    gather_trajectories,
    gather_trajectory_groups,
    retry,
)
from .core.model import Model, TrainableModel, TrainResult  # noqa: E402
from .core.trajectory import History, Trajectory, TrajectoryGroup  # noqa: E402

__all__ = [
    "EngineDiedError",
    "History",
    "LoRAConfig",
    "LocalBackend",
    "Model",
    "TooManyExceptions",
    "TrainConfig",
    "TrainResult",
    "TrainableModel",
    "TrainerConfig",
    "Trajectory",
    "TrajectoryGroup",
    "gather_trajectories",
    "gather_trajectory_groups",
    "models",
    "retry",
]
