import asyncio

import pytest

import artnb as art


async def rollout(reward: float, delay: float = 0.0, fail: bool = False) -> art.Trajectory:
    await asyncio.sleep(delay)
    if fail:
        raise RuntimeError("rollout broke")
    return art.Trajectory(
        messages_and_choices=[{"role": "user", "content": "hi"}], reward=reward, metrics={"m": reward}
    )


async def test_groups_keep_input_order_and_trajectories():
    groups = await art.gather_trajectory_groups(
        art.TrajectoryGroup(rollout(g * 10 + i, delay=0.01 * (3 - i)) for i in range(3)) for g in range(4)
    )
    assert [sorted(gr.rewards()) for gr in groups] == [[g * 10 + i for i in range(3)] for g in range(4)]


async def test_failures_within_budget_are_kept_in_exceptions():
    groups = await art.gather_trajectory_groups(
        [art.TrajectoryGroup([rollout(1), rollout(2, fail=True), rollout(3)])], max_exceptions=1
    )
    assert len(groups[0]) == 2
    assert groups[0].exceptions[0].type == "RuntimeError"
    assert "rollout broke" in groups[0].exceptions[0].message


async def test_fraction_budget_and_overflow_raises_first_failure():
    make = lambda: [art.TrajectoryGroup([rollout(1), rollout(0, fail=True)]) for _ in range(2)]  # noqa: E731
    groups = await art.gather_trajectory_groups(make(), max_exceptions=0.5)
    assert sum(len(g.exceptions) for g in groups) == 2
    with pytest.raises(art.TooManyExceptions) as info:
        await art.gather_trajectory_groups(make(), max_exceptions=0.25)
    assert isinstance(info.value.__cause__, RuntimeError)


async def test_after_each_can_replace_drop_or_split_groups():
    async def after(g: art.TrajectoryGroup):
        first = g.trajectories[0].reward
        if first == 0:
            return None
        if first == 1:
            return [g, g]
        return art.TrajectoryGroup([t.model_copy(update={"reward": -t.reward}) for t in g])

    groups = await art.gather_trajectory_groups(
        [art.TrajectoryGroup([rollout(r), rollout(r)]) for r in (0, 1, 2)], after_each=after
    )
    assert [g.rewards() for g in groups] == [[1, 1], [1, 1], [-2, -2]]


def groups_whose_after_each_fails_on_the_first() -> tuple[list, object]:
    """Three groups; after_each fails at once on group 0 while groups 1 and 2 are still running."""

    async def after(g: art.TrajectoryGroup) -> art.TrajectoryGroup:
        if g.trajectories[0].reward == 0:
            raise RuntimeError("judge down")
        return art.TrajectoryGroup([t.model_copy(update={"reward": 10 * t.reward}) for t in g])

    groups = [
        art.TrajectoryGroup([rollout(r, delay=0.1 * r), rollout(r)], metadata={"scenario": r})
        for r in (0, 1, 2)
    ]
    return groups, after


async def test_a_failing_after_each_drops_only_its_group_by_default(caplog):
    groups, after = groups_whose_after_each_fails_on_the_first()
    out = await art.gather_trajectory_groups(groups, after_each=after)
    assert isinstance(out, list) and [g.rewards() for g in out] == [[10, 10], [20, 20]]
    (failure,) = out.after_each_failures
    assert failure.group_index == 0 and failure.error.type == "RuntimeError"
    assert failure.error.message == "judge down"
    assert "after_each failed on group 0 (metadata {'scenario': 0}); leaving it out" in caplog.text


async def test_a_failing_after_each_can_keep_the_group_as_it_was_or_stop_the_gather():
    groups, after = groups_whose_after_each_fails_on_the_first()
    out = await art.gather_trajectory_groups(groups, after_each=after, after_each_errors="keep")
    assert [g.rewards() for g in out] == [[0, 0], [10, 10], [20, 20]]
    assert out[0].metrics == {"after_each_error": 1} and out[0].logs == [
        "after_each failed: RuntimeError: judge down"
    ]
    assert out[1].metrics == {} and len(out.after_each_failures) == 1
    groups, after = groups_whose_after_each_fails_on_the_first()
    with pytest.raises(RuntimeError, match="judge down"):
        await art.gather_trajectory_groups(groups, after_each=after, after_each_errors="raise")
    with pytest.raises(ValueError, match="after_each_errors must be 'drop', 'keep' or 'raise', got 'skip'"):
        await art.gather_trajectory_groups([], after_each=after, after_each_errors="skip")


async def test_awaiting_a_group_alone_runs_it():
    group = await art.TrajectoryGroup(rollout(i) for i in range(3))
    assert isinstance(group, art.TrajectoryGroup) and sorted(group.rewards()) == [0, 1, 2]


async def test_a_rollout_returning_the_wrong_type_is_named():
    async def bad():
        return {"reward": 1}

    with pytest.raises(art.TooManyExceptions) as info:
        await art.gather_trajectory_groups([art.TrajectoryGroup([bad(), rollout(1)])])
    assert "must return an art.Trajectory" in str(info.value.__cause__)


async def test_gather_trajectories_returns_exceptions_in_place():
    out = await art.gather_trajectories([rollout(1), rollout(2, fail=True)], max_exceptions=1)
    assert out[0].reward == 1 and isinstance(out[1], RuntimeError)


async def test_retry_async_and_sync():
    calls = []

    @art.retry(max_attempts=3, delay=0.001, exceptions=(ValueError,))
    async def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ValueError("again")
        return "ok"

    assert await flaky() == "ok" and len(calls) == 3

    @art.retry(max_attempts=2, delay=0.001)
    def always():
        raise KeyError("no")

    with pytest.raises(KeyError):
        always()


def test_trajectory_track_duration_and_messages():
    from openai.types.chat.chat_completion import Choice

    t = art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}])
    t.messages_and_choices.append(
        Choice(index=0, finish_reason="stop", message={"role": "assistant", "content": None}, logprobs=None)
    )

    async def timed():
        async with t.track_duration("llm"):
            await asyncio.sleep(0.01)

    asyncio.run(timed())
    assert t.metrics["llm_duration"] >= 0.01
    assert t.messages() == [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]
    assert t.trainable_turns() == 1
    with pytest.raises(TypeError, match="message dicts or Choice"):
        art.Trajectory(messages_and_choices=["just text"])


async def test_progress_counts_rollouts_when_a_rollout_returns_several_trajectories(capsys):
    async def game() -> list[art.Trajectory]:  # e.g. self-play: one game, a trajectory per player
        return [await rollout(1), await rollout(0), await rollout(0.5)]

    out = await art.gather_trajectories([game(), game()], pbar_desc="games")
    assert [len(x) for x in out] == [3, 3]
    err = capsys.readouterr().err
    assert "games: 100%" in err and "2/2" in err and "6/2" not in err


class Counted:
    """Rollouts that count how many started, to show a refused gather started none."""

    def __init__(self) -> None:
        self.started = 0

    async def rollout(self, reward: float = 1.0, fail: bool = False) -> art.Trajectory:
        self.started += 1
        return await rollout(reward, fail=fail)

    def groups(self, n: int = 2) -> list:
        return [art.TrajectoryGroup([self.rollout(), self.rollout()]) for _ in range(n)]


def close_unstarted(groups: list) -> None:
    """Close the coroutines a refused gather never ran (else Python warns about each one)."""
    for g in groups:
        for aw in getattr(g, "awaitables", g if isinstance(g, list) else []):
            aw.close()


async def test_a_non_callable_after_each_is_refused_before_any_rollout_runs():
    counted = Counted()
    groups = counted.groups()
    with pytest.raises(
        TypeError, match=r"after_each must be a function .*got str 'ruler'.*ruler_score_group"
    ):
        await art.gather_trajectory_groups(groups, after_each="ruler")  # type: ignore[arg-type]
    assert counted.started == 0
    close_unstarted(groups)


@pytest.mark.parametrize("policy", ["drop", "keep"])
async def test_after_each_returning_the_wrong_type_fails_only_its_group(policy):
    """A wrong return value is that group's after_each failure: the other groups are kept, not cancelled."""

    def after(g: art.TrajectoryGroup):
        reward = g.trajectories[0].reward
        return {"score": 1} if reward == 0 else [g, None] if reward == 1 else g

    groups = [art.TrajectoryGroup([rollout(r), rollout(r)]) for r in (0, 1, 2)]
    out = await art.gather_trajectory_groups(groups, after_each=after, after_each_errors=policy)
    kept = [[2, 2]] if policy == "drop" else [[0, 0], [1, 1], [2, 2]]
    assert [g.rewards() for g in out] == kept
    first, second = out.after_each_failures
    assert (first.group_index, first.error.type) == (0, "TypeError")
    assert "after_each returned dict" in first.error.message
    assert (
        "return a TrajectoryGroup, None (to drop the group) or a list of TrajectoryGroups"
        in first.error.message
    )
    assert "list whose item 1 is NoneType" in second.error.message
    with pytest.raises(TypeError, match="after_each returned dict"):
        await art.gather_trajectory_groups(
            [art.TrajectoryGroup([rollout(0)])], after_each=after, after_each_errors="raise"
        )


@pytest.mark.parametrize(
    ("budget", "error"),
    [(None, TypeError), ("2", TypeError), (True, TypeError), (float("nan"), ValueError), (-1, ValueError)],
)
async def test_a_bad_max_exceptions_is_refused_before_any_rollout_runs(budget, error):
    counted = Counted()
    groups = counted.groups()
    with pytest.raises(error, match=r"max_exceptions must be a count .* or a fraction of all rollouts .*got"):
        await art.gather_trajectory_groups(groups, max_exceptions=budget)
    assert counted.started == 0
    close_unstarted(groups)
    with pytest.raises(error, match="max_exceptions must be"):
        await art.gather_trajectories([], max_exceptions=budget)


async def test_a_fractional_count_is_refused_and_inf_tolerates_every_failure():
    with pytest.raises(ValueError, match=r"must be whole \(got 1.5\); pass a count such as max_exceptions=1"):
        await art.gather_trajectory_groups([], max_exceptions=1.5)
    make = lambda: [art.TrajectoryGroup([rollout(1, fail=True), rollout(1, fail=True)])]  # noqa: E731
    out = await art.gather_trajectory_groups(make(), max_exceptions=float("inf"))
    assert len(out[0].exceptions) == 2
    out = await art.gather_trajectory_groups(
        make(), max_exceptions=2.0
    )  # a whole float is a count, as in ART
    assert len(out[0].exceptions) == 2
    with pytest.raises(art.TooManyExceptions, match=r"1.0 is a count of one failure.*float\('inf'\)"):
        await art.gather_trajectory_groups(make(), max_exceptions=1.0)


async def test_groups_passed_the_wrong_way_say_how_to_pass_them():
    counted = Counted()
    (group,) = counted.groups(1)
    with pytest.raises(
        TypeError, match=r"got a single PendingGroup\); pass a list: gather_trajectory_groups\(\[group\]\)"
    ):
        await art.gather_trajectory_groups(group)  # type: ignore[arg-type]
    lists = [[counted.rollout(), counted.rollout()]]
    with pytest.raises(
        TypeError, match=r"item 0 is not a group \(got list\); wrap each list in art.TrajectoryGroup"
    ):
        await art.gather_trajectory_groups(lists)  # type: ignore[arg-type]
    assert counted.started == 0
    close_unstarted([group, *lists])
    finished = art.TrajectoryGroup([art.Trajectory(messages_and_choices=[], reward=1)])
    with pytest.raises(TypeError, match="got a single TrajectoryGroup"):
        await art.gather_trajectory_groups(finished)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"got Trajectory\); wrap the trajectories of one scenario"):
        await art.gather_trajectory_groups([finished.trajectories[0]])  # type: ignore[list-item]
