"""`gather_trajectory_groups` takes ART's progress-bar keywords: `max_metrics` limits the running means shown on
the bar (reward first), and the deprecated `pbar_total_completion_tokens=True` is accepted and reported once."""

from __future__ import annotations

import warnings

import pytest

import artnb as art
from artnb.core import ignored, progress


async def rollout(i: int) -> art.Trajectory:
    trajectory = art.Trajectory(messages_and_choices=[{"role": "user", "content": str(i)}], reward=i / 4)
    trajectory.metrics.update(win=float(i % 2), num_moves=i, length=i * 3)
    return trajectory


async def test_max_metrics_limits_the_bar_to_the_reward_first(monkeypatch):
    shown: list[dict[str, str]] = []
    original = progress.RolloutProgress.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        set_postfix = self.bar.set_postfix

        def record(postfix=None, refresh=True, **kw):
            shown.append(dict(postfix or {}, **kw))
            return set_postfix(postfix, refresh=refresh, **kw)

        self.bar.set_postfix = record

    monkeypatch.setattr(progress.RolloutProgress, "__init__", spy)
    groups = await art.gather_trajectory_groups(
        (art.TrajectoryGroup(rollout(i) for i in range(4)) for _ in range(2)),
        pbar_desc="gather",
        max_metrics=2,
    )
    assert [len(g) for g in groups] == [4, 4]
    assert shown and all(len(p) <= 2 for p in shown)
    assert all(next(iter(p)) == "reward" for p in shown)  # the reward is always the first one kept


async def test_deprecated_token_count_flag_is_accepted_and_reported_once(monkeypatch):
    monkeypatch.setattr(ignored, "_reported", set())
    with pytest.warns(UserWarning, match=r"pbar_total_completion_tokens=True\) is accepted"):
        groups = await art.gather_trajectory_groups(
            [art.TrajectoryGroup(rollout(i) for i in range(2))], pbar_total_completion_tokens=True
        )
    assert len(groups) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        await art.gather_trajectory_groups(
            [art.TrajectoryGroup(rollout(i) for i in range(2))], pbar_total_completion_tokens=True
        )


async def test_gather_trajectories_takes_the_deprecated_flag_too(monkeypatch):
    """ART 0.5.23's `gather_trajectories(..., pbar_total_completion_tokens=...)`: accepted, reported once."""
    monkeypatch.setattr(ignored, "_reported", set())
    with pytest.warns(
        UserWarning, match=r"gather_trajectories\(pbar_total_completion_tokens=True\) is accepted"
    ):
        out = await art.gather_trajectories([rollout(1), rollout(2)], pbar_total_completion_tokens=True)
    assert [t.reward for t in out] == [0.25, 0.5]  # type: ignore[union-attr]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        await art.gather_trajectories([rollout(3)], pbar_total_completion_tokens=False)
