"""`art.utils.get_trajectory_messages`: a trajectory's turns as plain chat messages, ART's import path for
`Trajectory.messages()` (ART's 2048 notebooks feed them back to the model)."""

from __future__ import annotations

from ..core.trajectory import Message, Trajectory


def get_trajectory_messages(trajectory: Trajectory) -> list[Message]:
    """The trajectory's messages, each sampled choice as the assistant message it holds. ART's version keeps only
    an assistant turn's text; this one keeps its tool calls too, so a tool-using history can be sent again."""
    return trajectory.messages()
