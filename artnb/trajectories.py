"""`artnb.trajectories`: ART's module path for the trajectory types (artnb/core/trajectory.py holds them)."""

from .core.trajectory import ExceptionRecord, History, Trajectory, TrajectoryGroup

PydanticException = ExceptionRecord  # ART's name for a failed rollout's record
LegacyHistory = History  # ART's later name for an additional history (messages_and_choices, tools)

__all__ = [
    "ExceptionRecord",
    "History",
    "LegacyHistory",
    "PydanticException",
    "Trajectory",
    "TrajectoryGroup",
]
