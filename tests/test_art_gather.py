"""`art.gather`'s pieces, used as ART's tic-tac-toe self-play example uses them: a gather of its own that runs
games returning one trajectory per seat and groups them by seat, under a bar it makes and an exception budget."""

from __future__ import annotations

import asyncio

import pytest
import tqdm

import artnb as art
from artnb.gather import GatherContext, set_gather_context, wrap_group_awaitable, wrap_trajectories_awaitable


async def gather_by_seat(
    games, *, max_exceptions: int | float = 0
) -> tuple[list[art.TrajectoryGroup], tqdm.tqdm]:
    """The example's `gather_trajectory_groups_by_index`, shortened: one group per seat."""
    games = list(games)
    context = GatherContext(pbar=None, pbar_total_completion_tokens=True, max_exceptions=max_exceptions)
    with set_gather_context(context):
        future = asyncio.gather(*[wrap_group_awaitable(g) for g in games])
        context.pbar = tqdm.tqdm(desc="gather", total=len(games) * 2)  # made after the tasks, before they run
        results = await future
    context.pbar.close()
    played = [r for r in results if r is not None]
    seats = [art.TrajectoryGroup([game[seat] for game in played]) for seat in range(2)]
    return seats, context.pbar


async def game(i: int, fail: bool = False) -> tuple[art.Trajectory, art.Trajectory]:
    await asyncio.sleep(0.001 * (5 - i))  # finish out of order
    if fail:
        raise RuntimeError(f"game {i} crashed")
    x = art.Trajectory(messages_and_choices=[], reward=1.0, metrics={"moves": i})
    o = art.Trajectory(messages_and_choices=[], reward=0.0, metrics={"moves": i})
    return x, o


async def test_a_gather_built_from_art_gathers_pieces_groups_by_seat_under_its_bar():
    seats, bar = await gather_by_seat(game(i) for i in range(4))
    assert [len(g.trajectories) for g in seats] == [4, 4]
    assert [t.metrics["moves"] for t in seats[0].trajectories] == [
        0,
        1,
        2,
        3,
    ]  # input order, not finish order
    assert {t.reward for t in seats[0].trajectories} == {1.0} and {
        t.reward for t in seats[1].trajectories
    } == {0.0}
    assert (
        bar.n == 8 and bar.postfix is not None and "reward=0.5" in bar.postfix and "moves=1.5" in bar.postfix
    )


async def test_failures_within_the_budget_are_dropped_and_beyond_it_raised():
    seats, bar = await gather_by_seat([game(0), game(1, fail=True), game(2)], max_exceptions=1)
    assert [len(g.trajectories) for g in seats] == [2, 2] and "exceptions=1" in bar.postfix
    with pytest.raises(RuntimeError, match="game 1 crashed"):
        await gather_by_seat([game(0), game(1, fail=True)])
    with pytest.raises(
        TypeError, match="wrap_group_awaitable takes a TrajectoryGroup or a sequence of art.Trajectory"
    ):

        async def not_trajectories():
            return {"reward": 1}

        await gather_by_seat([not_trajectories()])


async def test_wrap_trajectories_awaitable_counts_each_rollout_once_and_returns_a_tolerated_failure():
    async def one(i: int) -> art.Trajectory:
        if i == 1:
            raise ValueError("rollout 1 failed")
        return art.Trajectory(messages_and_choices=[], reward=float(i))

    context = GatherContext(pbar=tqdm.tqdm(total=3), max_exceptions=1)
    with set_gather_context(context):
        results = await asyncio.gather(*[wrap_trajectories_awaitable(one(i)) for i in range(3)])
    assert [r.reward if isinstance(r, art.Trajectory) else str(r) for r in results] == [
        0.0,
        "rollout 1 failed",
        2.0,
    ]
    assert context.pbar.n == 2 and context.exceptions == 1 and "reward=1" in context.pbar.postfix
