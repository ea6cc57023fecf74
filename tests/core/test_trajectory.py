"""Trajectories and groups refuse what they would silently drop or fail on later, naming the key and the fix."""

import math
import warnings

import numpy as np
import pytest
from pydantic import ConfigDict, Field

import artnb as art
from artnb.core.trajectory import check_trajectories, reward_problem, trajectory_problem

HI = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: art.Trajectory(messages_and_choice=[HI], reward=1), r"Trajectory has no field 'messages_and_choice'.*did you mean messages_and_choices="),
        (lambda: art.Trajectory(messages_and_choices=[HI], rewrad=1), r"no field 'rewrad'.*did you mean reward="),
        (lambda: art.TrajectoryGroup(trajectory=[art.Trajectory()]), r"TrajectoryGroup has no field 'trajectory'.*did you mean trajectories="),
        (lambda: art.TrajectoryGroup([art.Trajectory()], metadta={}), r"no field 'metadta'.*did you mean metadata="),
        (lambda: art.History(messages_and_choice=[HI]), r"History has no field 'messages_and_choice'"),
    ],
)  # fmt: skip
def test_a_misspelled_keyword_is_refused_with_the_closest_field(make, match):
    with pytest.raises(TypeError, match=match):
        make()


def test_a_keyword_near_no_field_is_reported_as_ignored_so_newer_art_code_runs():
    """A newer ART's field (its Trajectory has `exchanges`) is not a typo: said once, not refused."""
    with pytest.warns(UserWarning, match=r"Trajectory\(exchanges=...\) is accepted .* ignored"):
        trajectory = art.Trajectory(messages_and_choices=[HI], reward=1, exchanges={})
    assert trajectory.reward == 1


def test_a_misspelled_keyword_of_a_pending_group_fails_before_its_rollouts_run():
    async def rollout():
        raise AssertionError("ran")

    coroutine = rollout()
    with pytest.raises(TypeError, match="did you mean metadata="):
        art.TrajectoryGroup([coroutine], metdata={})
    coroutine.close()


def test_every_keyword_art_accepts_still_works():
    t = art.Trajectory(
        messages_and_choices=[HI],
        tools=[{"type": "function", "function": {"name": "f"}}],
        reward=1.0,
        metrics={"win": 1},
        metadata={"scenario": "a"},
        logs=["x"],
        additional_histories=[art.History(messages_and_choices=[HI], tools=None)],
        initial_policy_version=0,
        final_policy_version=1,
    )
    g = art.TrajectoryGroup(
        [t], exceptions=[ValueError("boom")], metadata={"s": 1}, metrics={"m": 1.0}, logs=["y"]
    )
    assert art.TrajectoryGroup(trajectories=[t]).trajectories == [t]
    again = art.TrajectoryGroup.model_validate_json(g.model_dump_json())  # as read back from disk
    assert again.trajectories[0].reward == 1.0 and again.exceptions[0].message == "boom"
    assert art.Trajectory.model_validate(t.model_dump()).metadata == {"scenario": "a"}


@pytest.mark.parametrize(
    "value, match",
    [
        (HI, r"\(got dict\); wrap the one message in a list"),
        (None, r"\(got None\); pass \[\] for an empty conversation"),
        ("hello", r"\(got str 'hello'\); pass e\.g\. \[\{'role': 'user'"),
    ],
)
def test_messages_and_choices_that_is_not_a_list_says_how_to_make_it_one(value, match):
    with pytest.raises(
        TypeError, match=rf"messages_and_choices takes a list of messages and choices {match}"
    ):
        art.Trajectory(messages_and_choices=value, reward=1.0)
    assert art.Trajectory(messages_and_choices=(m for m in [HI])).messages_and_choices == [HI]


def test_a_group_of_one_trajectory_says_to_wrap_it_in_a_list():
    with pytest.raises(
        TypeError, match=r"takes a list of trajectories \(got Trajectory\); wrap them in a list"
    ):
        art.TrajectoryGroup(art.Trajectory())
    with pytest.raises(TypeError, match=r"items must be .* \(got dict\); return an art\.Trajectory"):
        art.TrajectoryGroup([{"reward": 1}])


@pytest.mark.parametrize("reward", [np.float32(1.5), np.float64(-2.0), np.int64(3), 1, 0.5])
def test_real_number_rewards_numpy_ones_included_are_accepted_and_made_plain(reward):
    assert reward_problem(reward) is None
    g = art.TrajectoryGroup([art.Trajectory(), art.Trajectory()])
    g.trajectories[0].reward = reward
    g.trajectories[0].metrics.update(turns=np.int64(2), ok=np.bool_(True), share=np.float32(0.5))
    check_trajectories([g])
    t = g.trajectories[0]
    assert type(t.reward) is float and t.reward == float(reward)
    assert [type(v) for v in t.metrics.values()] == [int, bool, float]


@pytest.mark.parametrize(
    "spoil, match",
    [
        (lambda t: setattr(t, "reward", math.nan), r"group 1, trajectory 0 has reward nan; rewards must be finite"),
        (lambda t: setattr(t, "reward", "1"), r"has reward '1'; rewards must be numbers \(got str\)\. Set the reward"),
        (lambda t: setattr(t, "reward", True), r"rewards must be numbers \(got bool\)"),
        (lambda t: setattr(t, "reward", 1e13), r"beyond \+-1e\+12.*Scale the reward down"),
        (lambda t: t.metrics.update(winner="x"), r"group 1, trajectory 0 has metrics\['winner'\] = 'x' \(got str\); metrics must be numbers"),
        (lambda t: t.metrics.update(winner=None), r"metrics\['winner'\] = None \(got NoneType\)"),
        (lambda t: setattr(t, "metrics", [1]), r"has metrics \[1\] \(got list\); metrics must be a dict"),
    ],
)  # fmt: skip
def test_one_check_names_group_trajectory_and_key_of_a_bad_reward_or_metric(spoil, match):
    groups = [art.TrajectoryGroup([art.Trajectory(), art.Trajectory()]) for _ in range(2)]
    assert trajectory_problem(1, 0, groups[1].trajectories[0]) is None
    spoil(groups[1].trajectories[0])
    assert trajectory_problem(1, 0, groups[1].trajectories[0]) is not None
    with pytest.raises(ValueError, match=rf"{match}.*Nothing was trained\.$"):
        check_trajectories(groups)


def test_a_bad_group_metric_is_named_too():
    g = art.TrajectoryGroup([art.Trajectory(), art.Trajectory()])
    g.metrics["judge"] = "n/a"
    with pytest.raises(ValueError, match=r"group 0 has metrics\['judge'\] = 'n/a' \(got str\)"):
        check_trajectories([g], then="Nothing was logged")


def test_a_users_subclass_keeps_its_aliases_and_extra_fields():
    """ART's examples subclass Trajectory (art-e's ProjectTrajectory): pydantic's own rules still hold."""

    class Aliased(art.Trajectory):
        scenario_id: int = Field(0, alias="scenarioId")

    class Open(art.Trajectory):
        model_config = ConfigDict(extra="allow")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Aliased(messages_and_choices=[HI], reward=1, scenarioId=3).scenario_id == 3
        assert Open(messages_and_choices=[HI], reward=1, scenario_id=3).model_extra == {"scenario_id": 3}


NESTED = {"tags": ["a", "b"], "cfg": {"x": 1, "y": [1.5, None, True]}, "note": "ok"}


def test_nested_json_metadata_comes_back_the_same_from_parquet_and_the_wire(tmp_path):
    """ART's metadata is any JSON value: the run directory and the remote backend's wire give it back as it was."""
    from artnb.core.store import RunStore
    from artnb.core.wire import dumps, groups_from_wire, groups_to_wire, loads

    group = art.TrajectoryGroup([art.Trajectory(messages_and_choices=[HI], reward=1, metadata=NESTED)])
    check_trajectories([group])
    store = RunStore(tmp_path, "p", "m")
    store.write_trajectories("val", 0, [group])
    assert store.read_trajectories("val", 0)[0][0].metadata == NESTED
    assert groups_from_wire(loads(dumps(groups_to_wire([group]))))[0][0].metadata == NESTED


def test_numpy_values_in_metadata_become_plain_numbers_and_tuples_lists():
    t = art.Trajectory(metadata={"cfg": {"n": np.int64(3), "pair": (np.float32(0.5), "x")}})
    check_trajectories([art.TrajectoryGroup([t])])
    assert t.metadata == {"cfg": {"n": 3, "pair": [0.5, "x"]}}
    assert type(t.metadata["cfg"]["n"]) is int


@pytest.mark.parametrize(
    "metadata, match",
    [
        ({"when": {"at": object()}}, r"metadata\['when'\]\['at'\] of type object"),
        ({"tags": [1, {2, 3}]}, r"metadata\['tags'\]\[1\] of type set"),
        ({"cfg": {1: "a"}}, r"metadata\['cfg'\] key 1 of type int"),
    ],
)
def test_metadata_that_json_cannot_hold_is_named_with_the_fix(metadata, match):
    t = art.Trajectory(messages_and_choices=[HI], metadata=metadata)
    with pytest.raises(ValueError, match=rf"group 0, trajectory 0 has {match}.*store a JSON value instead"):
        check_trajectories([art.TrajectoryGroup([t])], then="Nothing was logged")


def test_group_log_appends_to_its_logs():
    group = art.TrajectoryGroup([art.Trajectory()])
    group.log("judge timed out")
    group.log("retried")
    assert group.logs == ["judge timed out", "retried"]
