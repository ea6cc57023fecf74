"""`art.utils.benchmark_rollout`: a prompted model's mean reward over some rollouts, ART's quick baseline."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from ..core.gather import gather_trajectory_groups
from ..core.trajectory import Trajectory, TrajectoryGroup


async def benchmark_rollout(
    model: Any,
    num_rollouts: int,
    rollout: Callable[[Any, int, bool], Awaitable[Trajectory]],
) -> float:
    """Run `rollout(model, i, False)` for i in range(num_rollouts) as one group (a progress bar shows them), print
    and return their mean reward. `model` is whatever the rollout takes (ART passes a model name). For an
    interval rather than one number, see `art.evaluate`."""
    if num_rollouts < 1:
        raise ValueError(f"num_rollouts={num_rollouts}: run at least one rollout")
    (group,) = await gather_trajectory_groups(
        [TrajectoryGroup(rollout(model, i, False) for i in range(num_rollouts))],
        pbar_desc="benchmark rollout",
    )
    rewards = [t.reward for t in group.trajectories]  # a failed rollout raised (TooManyExceptions), as in ART
    mean = sum(rewards) / len(rewards)
    print(f"Average reward for {getattr(model, 'name', model)}: {mean}")
    return mean
