"""Preflight's verdicts on constructed batches (equal rewards, NaN rewards, rollouts that raise, repeated or
cut-off replies), and on real rollouts judged by a local OpenAI-compatible judge that answers garbage
(fake_openai.py: a uvicorn server, nothing patched). Nothing here needs a model: a rollout is any function."""

from __future__ import annotations

import math

import pytest
from fake_openai import FakeJudge, good, malformed, only_for
from openai.types.chat.chat_completion import Choice
from transformers import AutoTokenizer

import artnb as art
from artnb.core.preflight import Batch, diagnose
from artnb.core.tokenize import dropped_tool_parts


def choice(text: str, finish_reason: str = "stop", logprobs: bool = True) -> Choice:
    tokens = [{"token": t, "logprob": -0.5, "bytes": None, "top_logprobs": []} for t in text]
    return Choice.model_validate(
        {
            "index": 0,
            "finish_reason": finish_reason,
            "message": {"role": "assistant", "content": text},
            "logprobs": {"content": tokens} if logprobs else None,
        }
    )


def rollout_of(reply: str, reward: float, **choice_options) -> art.Trajectory:
    messages = [{"role": "user", "content": "Say something, points=3"}, choice(reply, **choice_options)]
    return art.Trajectory(messages_and_choices=messages, reward=reward)


def group(*rewards: float, replies: list[str] | None = None) -> art.TrajectoryGroup:
    replies = replies or [f"reply {i}" for i in range(len(rewards))]
    return art.TrajectoryGroup(rollout_of(r, w) for r, w in zip(replies, rewards, strict=True))


def checks_of(batch: Batch) -> dict[str, art.core.preflight.Check]:
    return {c.name: c for c in diagnose(batch)}


def test_a_batch_that_can_learn_passes():
    checks = checks_of(Batch([group(0, 1, 0.5), group(1, 0, 0)], rollout_s=3.0))
    assert {c.status for c in checks.values()} == {"ok"}
    assert checks["groups whose rewards differ"].finding == "2 of 2 groups (these train)"
    assert checks["sampled tokens per rollout"].finding == "7 (max 7)"
    assert "measured by the first step" in checks["time per step of 2 groups"].finding


def test_equal_rewards_everywhere_cannot_learn_and_says_what_to_change():
    report = art.PreflightReport(diagnose(Batch([group(0, 0, 0), group(1, 1, 1)])), Batch([]))
    assert not report.ok
    assert report.verdict.startswith("cannot learn yet: 0 of 2 groups: every group scored alike")
    assert "raise the temperature or the group size" in report.verdict
    assert "FAIL groups whose rewards differ" in str(report)


def test_most_groups_equal_is_a_warning():
    checks = checks_of(Batch([group(0, 0, 0), group(0, 0, 0), group(0, 1, 0), group(0, 0, 0)]))
    differ = checks["groups whose rewards differ"]
    assert differ.status == "warn" and "1 of 4 groups: 3 groups with equal rewards" in differ.finding


def test_nan_rewards_fail_naming_the_fix():
    check = checks_of(Batch([group(0, math.nan, 1)]))["rewards are finite numbers"]
    assert (
        check.status == "fail"
        and "1 of 3 rewards cannot train (e.g. nan: rewards must be finite" in check.finding
    )
    assert "return a finite reward" in check.advice
    huge = checks_of(Batch([group(0, 1e15, 1)]))["rewards are finite numbers"]
    assert huge.status == "fail" and "beyond +-1e+12" in huge.finding


def test_repeated_and_cut_off_replies_warn():
    same = group(0, 1, 0, replies=["B2", "B2", "B2"])
    cut = art.TrajectoryGroup(rollout_of(f"long {i}", i, finish_reason="length") for i in range(3))
    checks = checks_of(Batch([same, cut]))
    repeats = checks["rollouts that differ from their siblings"]
    assert repeats.status == "ok" and repeats.finding == "4 of 6 distinct within their group"
    assert checks["replies that finished"].status == "warn"
    assert checks["replies that finished"].finding == "3 of 6 replies stopped at max_tokens"
    all_same = checks_of(Batch([group(0, 1, 0, replies=["x", "x", "x"])]))
    repeats = all_same["rollouts that differ from their siblings"]
    assert (
        repeats.status == "warn"
        and repeats.finding == "2 of 3 rollouts repeat a sibling word for word (1 groups all alike)"
    )
    assert "temperature" in repeats.advice


def test_a_rollout_without_a_choice_fails():
    plain = art.Trajectory(messages_and_choices=[{"role": "assistant", "content": "hi"}], reward=1.0)
    check = checks_of(Batch([art.TrajectoryGroup([plain, rollout_of("a", 0)])]))["trainable turns"]
    assert check.status == "warn" and "append completion.choices[0]" in check.advice


async def test_a_rollout_that_raises_is_a_finding_not_a_crash():
    async def rollout(model, scenario):
        if scenario == 1:
            raise KeyError("board 1 has no cell Z9")
        return rollout_of(f"move {scenario}", float(scenario))

    report = await art.preflight(art.Model(name="m"), rollout, [0, 1], group_size=2)
    finished = {c.name: c for c in report.checks}["rollouts that finished"]
    assert finished.status == "warn" and "2 of 4 rollouts raised (first: KeyError" in finished.finding
    assert len(report.groups) == 2 and [len(g) for g in report.groups] == [2, 0]

    async def broken(model, scenario):
        raise RuntimeError("no server")

    report = await art.preflight(art.Model(name="m"), broken, [0], group_size=2)
    assert not report.ok and report.verdict.startswith("cannot learn yet: 2 of 2 rollouts raised")


async def test_a_rollout_that_returns_its_reward_is_captured_not_refused():
    """The README's captured rollouts return a number: preflight plays them as art.trajectory would."""

    async def rollout(model, scenario):
        return 0.5 * scenario

    report = await art.preflight(art.Model(name="m"), rollout, [0, 1], group_size=2)
    assert {c.name: c for c in report.checks}["rollouts that finished"].status == "ok"
    assert [g.rewards() for g in report.groups] == [[0.0, 0.0], [0.5, 0.5]]


async def test_preflight_refuses_bad_arguments():
    with pytest.raises(ValueError, match="at least one scenario"):
        await art.preflight(art.Model(name="m"), lambda m, s: None, [])
    with pytest.raises(ValueError, match="group_size=1"):
        await art.preflight(art.Model(name="m"), lambda m, s: None, [0], group_size=1)


@pytest.fixture(scope="module")
def judge():
    with FakeJudge() as server:
        yield server


async def judged_preflight(judge, tmp_path) -> art.PreflightReport:
    async def rollout(model, scenario):
        return rollout_of(f"answer {scenario}", 0.0)

    # the judge sees "points=3" in every prompt; the last message of each rollout differs
    return await art.preflight(
        art.Model(name="m"),
        rollout,
        [0, 1],
        group_size=3,
        judge="openai/judge",
        judge_params={"api_base": judge.url, "api_key": "k"},
    )


async def test_a_judge_that_answers_garbage_fails_with_its_error(judge, tmp_path):
    judge.script.clear()
    judge.default = malformed  # broken JSON, and again when shown the problem
    try:
        report = await judged_preflight(judge, tmp_path)
    finally:
        judge.default = good
    replies = {c.name: c for c in report.checks}["judge replies"]
    assert replies.status == "fail" and "failed on 2 of 2 groups" in replies.finding
    assert not report.ok and report.groups == []


async def test_a_judge_that_fails_on_one_group_warns_and_keeps_the_other(judge, tmp_path):
    judge.script.clear()
    judge.default = only_for("answer 1", malformed)  # every reply about group 1 is unusable, retries too
    try:
        report = await judged_preflight(judge, tmp_path)
    finally:
        judge.default = good
    checks = {c.name: c for c in report.checks}
    assert (
        checks["judge replies"].status == "warn"
        and "failed on 1 of 2 groups" in checks["judge replies"].finding
    )
    assert len(report.groups) == 1 and "ruler_score" in report.groups[0].trajectories[0].metrics
    # the rollouts' own rewards are all 0: the judge's scores train, agreement cannot be measured
    assert checks["groups whose rewards differ"].status == "warn"
    assert checks["judge agrees with your reward"].finding.startswith("not measurable")
    assert "judge" in checks["time per step of 2 groups"].finding


def judged(*pairs: tuple[float, float]) -> art.TrajectoryGroup:
    """A group as the judge returns it: the judge's score is the reward, the task's own in independent_reward."""
    g = group(*(score for score, _ in pairs))
    for t, (score, own) in zip(g.trajectories, pairs, strict=True):
        t.metrics.update(ruler_score=score, independent_reward=own)
    return g


def test_judge_agreement_over_too_few_groups_is_a_warning_not_a_pass():
    agreeing = judged((1.0, 1.0), (0.0, 0.0), (0.5, 0.5))
    one = checks_of(Batch([agreeing], judged=[agreeing], judge_label="judge"))[
        "judge agrees with your reward"
    ]
    assert one.status == "warn" and "over only 1 group(s)" in one.finding and "too few" in one.finding
    three = [judged((1.0, 1.0), (0.0, 0.0), (0.5, 0.5)) for _ in range(3)]
    enough = checks_of(Batch(three, judged=three, judge_label="judge"))["judge agrees with your reward"]
    assert enough.status == "ok" and enough.finding == "mean Spearman 1.00 over 3 groups"


async def test_groups_gathered_elsewhere_get_the_same_checks():
    report = await art.preflight_groups([group(0, 1), group(1, 1)])
    checks = {c.name: c for c in report.checks}
    assert checks["groups whose rewards differ"].finding == "1 of 2 groups (these train)"
    assert "rollouts: not timed here" in checks["time per step of 2 groups"].finding
    assert report.ok and report.groups[1].rewards() == [1, 1]


def test_a_chat_template_that_drops_the_rollouts_tools_warns_with_the_fix():
    """Measured with the tiny model's tokenizer (SmolLM2's template renders neither tools nor tool calls)."""
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    groups = [group(0, 1), group(1, 0)]
    plain = [t for g in groups for t in g.trajectories]
    tokenizer = AutoTokenizer.from_pretrained(art.models.tiny())
    assert dropped_tool_parts(tokenizer, plain) == []
    for t in plain:
        t.tools = tools
    dropped = dropped_tool_parts(tokenizer, plain)
    assert dropped == ["the tool definitions (trajectory.tools)"]
    check = checks_of(Batch(groups=groups, tools_dropped=dropped))["chat template renders the tools"]
    assert check.status == "warn" and "trajectory.tools" in check.finding
    assert "chat_template" in check.advice and "system prompt" in check.advice
    assert "chat template renders the tools" not in checks_of(Batch(groups=groups))
