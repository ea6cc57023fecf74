"""Property-based tests (hypothesis) of what takes user data: rewards and trajectories, advantages and the loss,
tokenisation and the assistant mask, RULER's reading of a judge's reply, and iterate_dataset.

Each property holds for every input hypothesis generates (a bounded number of examples, so the file runs in
seconds); a failure prints the smallest input that breaks it. Found by this file and fixed: rewards near the
float limit (1e308) made every advantage NaN (now refused beyond +-1e12, and advantages are computed without
overflow for any finite rewards).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from openai.types.chat.chat_completion import Choice
from transformers import AutoTokenizer

import artnb.models
from artnb.core.grpo import LossSettings, group_advantages, policy_loss
from artnb.core.ruler import _parse, _Unusable
from artnb.core.store import _rollout_frame, read_rollouts
from artnb.core.tokenize import tokenize_trajectory
from artnb.core.trajectory import MAX_ABS_REWARD, Trajectory, TrajectoryGroup, check_trajectories
from artnb.utils.iterate_dataset import iterate_dataset

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
rewards_in_range = st.floats(-MAX_ABS_REWARD, MAX_ABS_REWARD, allow_nan=False)
any_float = st.floats(allow_nan=True, allow_infinity=True)
text = st.text(max_size=200)  # any unicode, surrogates excluded by hypothesis for str


# Rewards and advantages -------------------------------------------------------------------------------------


@FAST
@given(st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=1, max_size=32), st.booleans())
def test_advantages_are_finite_centred_and_keep_the_order(rewards, scale):
    """For any finite rewards when scaled (art.explain shows any group), within +-1e12 when not (an unscaled
    advantage of 1e308 has no float)."""
    if not scale:
        rewards = [max(-MAX_ABS_REWARD, min(MAX_ABS_REWARD, r)) for r in rewards]
    advantages = group_advantages(rewards, scale_rewards=scale)
    assert all(math.isfinite(a) for a in advantages)
    spread = max(rewards) - min(rewards)
    if spread == 0:
        assert advantages == [0.0] * len(rewards)  # equal rewards: no signal at all
        return
    size = max(abs(a) for a in advantages)
    assert abs(math.fsum(advantages)) <= 1e-9 * size * len(rewards)
    ranked = [a for _, a in sorted(zip(rewards, advantages, strict=True))]
    assert ranked == sorted(ranked)  # a better reward never gets a smaller advantage
    if scale:
        assert size <= math.sqrt(len(rewards)) + 1e-9  # a z-score cannot exceed sqrt(n)


@FAST
@given(any_float)
def test_check_trajectories_accepts_exactly_the_finite_comparable_rewards(reward):
    group = TrajectoryGroup([Trajectory(reward=0.0), Trajectory(reward=0.0)])
    group.trajectories[1].reward = reward
    comparable = math.isfinite(reward) and abs(reward) <= MAX_ABS_REWARD
    if comparable:
        check_trajectories([group])
    else:
        with pytest.raises(ValueError, match="group 0, trajectory 1 has reward"):
            check_trajectories([group])


@FAST
@given(
    st.integers(1, 3),
    st.integers(1, 12),
    st.sampled_from(["ppo", "cispo"]),
    st.sampled_from(["token", "sequence", "average", "geometric_average"]),
    st.data(),
)
def test_the_loss_is_finite_for_any_finite_logprobs_and_advantages(rows, cols, loss_fn, level, data):
    logprob = st.floats(-30, 0, allow_nan=False)
    new = torch.tensor(data.draw(st.lists(logprob, min_size=rows * cols, max_size=rows * cols))).view(
        rows, cols
    )
    old = torch.tensor(data.draw(st.lists(logprob, min_size=rows * cols, max_size=rows * cols))).view(
        rows, cols
    )
    advantages = torch.tensor(data.draw(st.lists(st.floats(-10, 10), min_size=rows, max_size=rows)))
    mask = torch.tensor(data.draw(st.lists(st.booleans(), min_size=rows * cols, max_size=rows * cols)))
    mask = mask.view(rows, cols)
    assume(mask.any())
    loss, metrics = policy_loss(
        new.requires_grad_(),
        old,
        advantages[:, None].expand(rows, cols),
        mask,
        LossSettings(epsilon=0.2, epsilon_high=0.28, loss_fn=loss_fn, importance_sampling_level=level),
    )
    assert torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(new.grad).all()
    assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float))


# Trajectories ----------------------------------------------------------------------------------------------

tool_arguments = st.one_of(text, st.just('{"a": 1'), st.just("null"), st.just("[]"))


def choice(content: str | None, arguments: str | None = None) -> Choice:
    message: dict = {"role": "assistant", "content": content}
    if arguments is not None:
        message["tool_calls"] = [
            {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": arguments}}
        ]
    return Choice.model_validate({"index": 0, "finish_reason": "stop", "message": message, "logprobs": None})


@FAST
@given(text, text, st.one_of(st.none(), text), st.one_of(st.none(), tool_arguments), rewards_in_range)
def test_any_messages_round_trip_through_the_run_files(system, user, reply, arguments, reward):
    traj = Trajectory(
        messages_and_choices=[
            {"role": "system", "content": system},
            {"role": "user", "content": user},
            choice(reply, arguments),
        ],
        reward=reward,
        metadata={"note": user[:20]},
    )
    logged = traj.for_logging()
    json.dumps(logged, default=str)  # what W&B tables and the panels read
    frame = _rollout_frame([TrajectoryGroup([traj, traj.model_copy()])])
    back = read_rollouts_from(frame)
    assert back[0].trajectories[0].reward == reward
    assert back[0].trajectories[0].messages()[1]["content"] == user
    assert back[0].trajectories[0].messages()[2]["content"] == (reply or "")


def read_rollouts_from(frame):
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "rollouts.parquet"
        frame.to_parquet(path)
        return read_rollouts(path)


# Tokenisation ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(artnb.models.tiny())


vocab_ids = st.integers(min_value=100, max_value=40_000)  # ordinary tokens of SmolLM2's vocabulary


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(text, st.lists(vocab_ids, min_size=1, max_size=12)), min_size=1, max_size=3))
def test_every_sampled_id_is_trained_as_sampled_and_nothing_else(tok, turns):
    """For SmolLM2's template (the one the embedded and tiny models ship): the mask holds exactly the sampled ids
    of every turn, in order, with the engine's logprobs; the prompt around them is never trained."""
    items: list = [{"role": "system", "content": "play"}]
    for user, ids in turns:
        items.append({"role": "user", "content": user})
        items.append(sampled_choice(tok, ids))
    [seq] = tokenize_trajectory(tok, Trajectory(messages_and_choices=items, reward=1.0), 1.0)
    trained = [i for i, m in zip(seq.token_ids, seq.assistant_mask, strict=True) if m]
    expected = [i for _, ids in turns for i in ids]
    assert trained[: len(expected)] == expected
    # beyond the sampled ids, only each turn's end-of-turn token the template writes may be trained
    assert len(trained) - len(expected) <= len(turns)
    logprobs = [lp for lp, m in zip(seq.logprobs, seq.assistant_mask, strict=True) if m]
    assert logprobs[: len(expected)] == pytest.approx([-0.5] * len(expected))


def sampled_choice(tok, ids: list[int]) -> Choice:
    return Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "length",
            "message": {"role": "assistant", "content": tok.decode(ids)},
            "logprobs": {
                "content": [
                    {"token": tok.decode([i]), "logprob": -0.5, "bytes": None, "top_logprobs": []}
                    for i in ids
                ]
            },
            "token_ids": ids,
        }
    )


# RULER's reading of the judge -----------------------------------------------------------------------------


@FAST
@given(
    st.integers(1, 8),
    st.lists(
        st.tuples(st.one_of(st.integers(0, 10).map(str), text), st.floats(allow_nan=True)),
        max_size=10,
    ),
)
def test_a_judge_reply_is_read_whole_or_refused(n, scored):
    """Any reply either gives every id exactly one score in [0, 1], or is refused as unusable; never a partial or
    misattributed mapping, never another exception."""
    ids = [str(i) for i in range(1, n + 1)]
    reply = json.dumps(
        {"scores": [{"trajectory_id": i, "explanation": "x", "score": s} for i, s in scored]}, allow_nan=True
    )
    try:
        found = _parse(reply, ids)
    except _Unusable:
        return
    assert sorted(found) == sorted(ids)
    assert all(0 <= s.score <= 1 and found[k].trajectory_id == k for k, s in found.items())


@FAST
@given(text)
def test_any_text_as_a_judge_reply_is_refused_cleanly_or_read(reply):
    try:
        _parse(reply, ["1", "2"])
    except _Unusable:
        pass


# iterate_dataset ------------------------------------------------------------------------------------------


@FAST
@given(st.integers(1, 30), st.integers(1, 8), st.integers(1, 3), st.data())
def test_every_epoch_visits_each_item_once_and_a_resume_continues_the_same_batches(
    size, per_step, epochs, data
):
    items = list(range(size))
    batches = list(iterate_dataset(items, per_step, epochs, use_tqdm=False))
    steps_per_epoch = math.ceil(size / per_step)
    assert len(batches) == steps_per_epoch * epochs
    for epoch in range(epochs):
        seen = [i for b in batches if b.epoch == epoch for i in b.items]
        assert sorted(seen) == items
    assert [b.step for b in batches] == list(range(len(batches)))
    start = data.draw(st.integers(0, len(batches)))
    resumed = list(iterate_dataset(items, per_step, epochs, initial_step=start, use_tqdm=False))
    assert resumed == batches[start:]
