"""`artnb.trajectories`: ART's module path for the trajectory types (artnb/core/trajectory.py holds them)."""

from .core.trajectory import ExceptionRecord, History, Trajectory, TrajectoryGroup

PydanticException = ExceptionRecord  # ART's name for a failed rollout's record

__all__ = ["ExceptionRecord", "History", "PydanticException", "Trajectory", "TrajectoryGroup"]
