"""RULER through litellm against a real local OpenAI-compatible server that answers from a script (fake_openai.py).

Each trajectory's last message says `points=K`; the scripted judge scores it K/10, so every test knows which
score belongs to which trajectory. The last test scores a real group with the embedded model on our engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from fake_openai import (
    FakeJudge,
    duplicate_id,
    good,
    malformed,
    score_out_of_range,
    slow,
    unknown_id,
    wrong_count,
)

import artnb as art
from artnb import JudgeRequestError, RulerError
from artnb.core.trajectory import ExceptionRecord

SYSTEM = {"role": "system", "content": "You play a counting game. Reach 10 points."}
TASK = {"role": "user", "content": "Start counting."}
TOOLS = [
    {"type": "function", "function": {"name": "count", "parameters": {"type": "object", "properties": {}}}}
]


def conversation(points: int, steps: int = 1) -> list[dict]:
    turns = [{"role": "assistant", "content": f"step {i}"} for i in range(steps - 1)]
    return [SYSTEM, TASK, *turns, {"role": "assistant", "content": f"I reached points={points}"}]


def make_group(points: list[int], rewards: list[float] | None = None) -> art.TrajectoryGroup:
    rewards = rewards or [p / 100 for p in points]
    return art.TrajectoryGroup(
        art.Trajectory(messages_and_choices=conversation(p), reward=r, tools=TOOLS, metadata={"n": i})
        for i, (p, r) in enumerate(zip(points, rewards, strict=True))
    )


@pytest.fixture(scope="module")
def judge():
    with FakeJudge() as server:
        yield server


@pytest.fixture
def fresh(judge, tmp_path):
    """The judge with an empty script and request log, and litellm arguments reaching it with a fresh cache."""
    judge.script.clear()
    judge.requests.clear()
    return {"api_base": judge.url, "api_key": "test-key"}, tmp_path / "cache"


def user_prompt(body: dict) -> str:
    return next(m["content"] for m in body["messages"] if m["role"] == "user")


async def test_scores_are_matched_by_id_not_position(judge, fresh):
    params, cache = fresh
    scores = await art.ruler([conversation(p) for p in (3, 9, 6)], "openai/judge", params, cache_dir=cache)
    assert [s.score for s in scores] == [0.3, 0.9, 0.6]  # the judge answered in reverse order
    assert [s.trajectory_id for s in scores] == ["1", "2", "3"]
    assert [s.explanation for s in scores] == ["earned 0.3", "earned 0.9", "earned 0.6"]
    (body,) = judge.requests
    assert body["model"] == "judge"
    schema = body["response_format"]["json_schema"]["schema"]
    assert body["response_format"]["type"] == "json_schema" and "scores" in schema["properties"]
    assert await art.ruler([], "openai/judge", params, cache_dir=cache) == []
    assert len(judge.requests) == 1


async def test_shared_prefix_is_sent_once_and_tools_are_included(judge, fresh):
    params, cache = fresh
    lists = [conversation(2, steps=3), conversation(5, steps=1)]
    await art.ruler(lists, "openai/judge", params, tools=TOOLS, cache_dir=cache)
    prompt = user_prompt(judge.requests[0])
    assert prompt.count(SYSTEM["content"]) == 1 and prompt.count(TASK["content"]) == 1
    context = prompt.split("<context>")[1].split("</context>")[0]
    assert json.loads(context) == [SYSTEM, TASK]
    tools = prompt.split("<tools>")[1].split("</tools>")[0]
    assert json.loads(tools) == TOOLS
    first = prompt.split('<trajectory id="1">')[1].split("</trajectory>")[0]
    assert json.loads(first) == lists[0][2:]


async def test_identical_trajectories_are_judged_once_and_share_the_score(judge, fresh):
    params, cache = fresh
    lists = [conversation(4), conversation(8), conversation(4), conversation(8), conversation(1)]
    scores = await art.ruler(lists, "openai/judge", params, cache_dir=cache)
    assert [s.score for s in scores] == [0.4, 0.8, 0.4, 0.8, 0.1]
    assert user_prompt(judge.requests[0]).count("<trajectory id=") == 3
    same = await art.ruler([conversation(6)] * 4, "openai/judge", params, cache_dir=cache)
    assert [s.score for s in same] == [0.6] * 4
    body = judge.requests[1]
    assert user_prompt(body).count("<trajectory id=") == 1 and "<context>" not in user_prompt(body)
    assert "single attempt" in body["messages"][0]["content"]


@pytest.mark.parametrize(
    ("bad", "shown"),
    [
        (malformed, "not the requested JSON"),
        (wrong_count, "no score for trajectory id 3"),
        (duplicate_id, "trajectory id 3 is scored more than once"),
        (unknown_id, "trajectory id '99' does not exist"),
        (score_out_of_range, "the score 7.0 for trajectory 3 is outside 0 to 1"),
    ],
)
async def test_a_bad_reply_is_retried_once_with_the_problem_shown(judge, fresh, bad, shown):
    params, cache = fresh
    judge.script.extend([bad, good])
    scores = await art.ruler([conversation(p) for p in (1, 2, 3)], "openai/judge", params, cache_dir=cache)
    assert [s.score for s in scores] == [0.1, 0.2, 0.3]
    first, second = judge.requests
    assert second["messages"][:2] == first["messages"]
    bad_reply, correction = second["messages"][2:]
    assert bad_reply["role"] == "assistant" and correction["role"] == "user"
    assert shown in correction["content"] and "1, 2, 3" in correction["content"]


async def test_two_bad_replies_are_a_clear_error_or_none_when_swallowed(judge, fresh):
    params, cache = fresh
    judge.script.extend([malformed, wrong_count])
    with pytest.raises(RulerError, match="unusable scores twice \\(no score for trajectory id 2\\)"):
        await art.ruler([conversation(p) for p in (1, 2)], "openai/judge", params, cache_dir=cache)
    assert len(judge.requests) == 2
    group = make_group([1, 2])
    before = group.model_dump()
    judge.script.extend([duplicate_id, duplicate_id])
    kwargs = {"swallow_exceptions": True, "cache_dir": cache}
    assert await art.ruler_score_group(group, "openai/judge", params, **kwargs) is None
    assert group.model_dump() == before and len(judge.requests) == 4
    assert not list(cache.rglob("*.json")), "failed answers must not be cached"


async def test_score_group_sets_metrics_reward_logs_and_leaves_the_input_alone(judge, fresh, capsys):
    params, cache = fresh
    group = make_group([2, 9, 5], rewards=[1.0, 0.0, 0.5])
    group.metadata["scenario"] = 7
    group.exceptions.append(ExceptionRecord(type="E", message="m", traceback=""))
    before = group.model_dump()
    scored = await art.ruler_score_group(group, "openai/judge", params, cache_dir=cache, debug=True)
    assert group.model_dump() == before
    assert scored is not group and scored.trajectories[0] is not group.trajectories[0]
    assert [t.metrics["independent_reward"] for t in scored] == [1.0, 0.0, 0.5]
    assert [t.metrics["ruler_score"] for t in scored] == [0.2, 0.9, 0.5]
    assert scored.rewards() == [0.2, 0.9, 0.5]
    assert [t.metadata["ruler_explanation"] for t in scored] == ["earned 0.2", "earned 0.9", "earned 0.5"]
    assert scored[1].logs == ["RULER score 0.9: earned 0.9"] and scored[1].metadata["n"] == 1
    assert scored.metadata == {"scenario": 7} and len(scored.exceptions) == 1
    assert '"trajectory_id": "3"' in capsys.readouterr().out
    # Scoring again keeps the rollout's own reward as independent_reward.
    again = await art.ruler_score_group(scored, "openai/judge", params, cache_dir=cache)
    assert [t.metrics["independent_reward"] for t in again] == [1.0, 0.0, 0.5]


async def test_combine_function_mixes_both_rewards(judge, fresh):
    params, cache = fresh
    group = make_group([2, 6], rewards=[1.0, -1.0])
    scored = await art.ruler_score_group(
        group,
        "openai/judge",
        params,
        combine=lambda independent, ruler: independent + 2 * ruler,
        cache_dir=cache,
    )
    assert scored.rewards() == pytest.approx([1.4, 0.2])


async def test_answers_are_cached_on_disk(judge, fresh, tmp_path, monkeypatch):
    params, cache = fresh
    lists = [conversation(p) for p in (1, 7)]
    first = await art.ruler(lists, "openai/judge", params, cache_dir=cache)
    again = await art.ruler(lists, "openai/judge", {**params, "api_key": "another"}, cache_dir=cache)
    assert again == first and len(judge.requests) == 1, "a repeated call must cost no request"
    assert len(list(cache.rglob("*.json"))) == 1
    await art.ruler(lists, "openai/judge", params, rubric="Prefer brevity.", cache_dir=cache)
    await art.ruler(lists, "openai/judge", {**params, "temperature": 0}, cache_dir=cache)
    await art.ruler([*lists, conversation(3)], "openai/judge", params, cache_dir=cache)
    assert len(judge.requests) == 4, "rubric, settings and content are part of the key"
    await art.ruler(lists, "openai/judge", params, cache=False, cache_dir=cache)
    await art.ruler(lists, "openai/judge", params, cache=False, cache_dir=cache)
    assert len(judge.requests) == 6
    monkeypatch.setenv("ARTNB_CACHE_DIR", str(tmp_path / "env"))
    await art.ruler(lists, "openai/judge", params)
    await art.ruler(lists, "openai/judge", params)
    assert len(judge.requests) == 7 and len(list((tmp_path / "env" / "ruler").rglob("*.json"))) == 1


async def test_art_model_judge_gets_a_schema_for_its_group(judge, fresh):
    params, cache = fresh
    model = art.Model(name="judge", inference_base_url=judge.url, inference_model_name="served-name")
    scores = await art.ruler([conversation(p) for p in (5, 0)], model, cache_dir=cache)
    assert [s.score for s in scores] == [0.5, 0.0]
    (body,) = judge.requests
    assert body["model"] == "served-name"
    schema = body["response_format"]["json_schema"]["schema"]["properties"]["scores"]
    assert [item["properties"]["trajectory_id"]["const"] for item in schema["prefixItems"]] == ["1", "2"]
    assert schema["minItems"] == schema["maxItems"] == 2
    unregistered = art.TrainableModel(name="policy", base_model=art.models.DEFAULT)
    with pytest.raises(ValueError, match="has no inference_base_url: register it"):
        await art.ruler([conversation(1)], unregistered, cache_dir=cache)


async def test_as_after_each_in_gather_judges_groups_concurrently(judge, fresh):
    params, cache = fresh
    judge.script.extend([slow(0.6)] * 3)

    async def rollout(points: int) -> art.Trajectory:
        return art.Trajectory(messages_and_choices=conversation(points), reward=0.0)

    start = time.monotonic()
    groups = await art.gather_trajectory_groups(
        (art.TrajectoryGroup(rollout(p + k) for p in (0, 3)) for k in range(3)),
        after_each=lambda g: art.ruler_score_group(
            g, "openai/judge", params, swallow_exceptions=True, cache_dir=cache
        ),
    )
    assert time.monotonic() - start < 1.5, "three slow judge calls should overlap"
    assert [g.rewards() for g in groups] == [[0.0, 0.3], [0.1, 0.4], [0.2, 0.5]]


async def test_a_judge_that_times_out_drops_the_group_when_swallowed(judge, fresh):
    params, cache = fresh
    slow_params = {**params, "timeout": 0.3, "num_retries": 0, "max_retries": 0}
    judge.script.extend([slow(2), slow(2)])
    with pytest.raises(JudgeRequestError, match="failed 1 attempt in .* no reply within 0.3 s"):
        await art.ruler([conversation(1)], "openai/judge", slow_params, cache_dir=cache)
    scored = await art.ruler_score_group(
        make_group([1, 2]), "openai/judge", slow_params, swallow_exceptions=True, cache_dir=cache
    )
    assert scored is None


async def test_groups_it_cannot_score(judge, fresh):
    params, cache = fresh
    empty = await art.ruler_score_group(art.TrajectoryGroup([]), "openai/judge", params, cache_dir=cache)
    assert empty is not None and len(empty) == 0 and not judge.requests
    group = make_group([1, 2])
    group.trajectories[1].additional_histories.append(art.History(messages_and_choices=[TASK]))
    with pytest.raises(ValueError, match="trajectory 1 has additional_histories"):
        await art.ruler_score_group(group, "openai/judge", params, cache_dir=cache)
    assert await art.ruler_score_group(group, "openai/judge", params, swallow_exceptions=True) is None


async def test_a_group_that_is_not_a_trajectory_group_says_how_to_make_one(judge, fresh):
    """Even with swallow_exceptions=True: that is for a failing judge, not for a wrong argument."""
    params, cache = fresh
    trajectories = make_group([1, 2]).trajectories
    for swallow in (False, True):
        with pytest.raises(
            TypeError, match=r"got list\); wrap the trajectories in art.TrajectoryGroup\(\[...\]\)"
        ):
            await art.ruler_score_group(
                trajectories,  # type: ignore[arg-type]
                "openai/judge",
                params,
                swallow_exceptions=swallow,
                cache_dir=cache,
            )

    async def one() -> art.Trajectory:
        return trajectories[0]

    pending = art.TrajectoryGroup([one()])
    with pytest.raises(TypeError, match=r"got PendingGroup\); await it first"):
        await art.ruler_score_group(pending, "openai/judge", params, cache_dir=cache)  # type: ignore[arg-type]
    await pending  # run it, so no coroutine is left unawaited
    assert not judge.requests


def test_importing_artnb_keeps_litellm_offline():
    """litellm fetches its model price list at import unless told not to; artnb tells it (before the import)."""
    code = (
        "import artnb, litellm\n"
        "from litellm.litellm_core_utils.get_model_cost_map import get_model_cost_map_source_info as info\n"
        'print(info()["source"], info()["is_env_forced"])'
    )
    env = {k: v for k, v in os.environ.items() if k != "LITELLM_LOCAL_MODEL_COST_MAP"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["local", "True"] and "fetch" not in out.stderr


@pytest.mark.slow
async def test_embedded_model_judges_a_real_group_on_the_hf_engine(tmp_path):
    """The offline default: the 135M base model on our HF engine, held to the schema while it decodes."""
    from artnb import models
    from artnb.backends.engines.hf.client import HFEngine

    async with HFEngine(models.embedded_model_path(), "base", tmp_path / "logs", device="cpu") as engine:
        judge_model = art.Model(
            name="judge",
            inference_base_url=engine.base_url,
            inference_api_key=engine.api_key,
            inference_model_name="base",
        )
        board = "  1 2 3\nA X . .\nB O X .\nC O . ."
        system = {
            "role": "system",
            "content": "You play tic-tac-toe as X. Reply with the name of one empty cell.",
        }
        answers = ["C3", "A2", "B2", "C1", "C3"]  # a win, a legal move, two illegal moves, the win again
        group = art.TrajectoryGroup(
            art.Trajectory(
                messages_and_choices=[
                    system,
                    {"role": "user", "content": board},
                    {"role": "assistant", "content": a},
                ],
                reward=r,
            )
            for a, r in zip(answers, [1.0, 0.1, -0.5, -0.5, 1.0], strict=True)
        )
        start = time.monotonic()
        scored = await art.ruler_score_group(
            group, judge_model, {"temperature": 0}, cache_dir=tmp_path / "cache"
        )
        elapsed = time.monotonic() - start
        print(f"\nembedded judge, {elapsed:.1f}s:")
        print(art.compare_rewards(scored).trajectories[["independent_reward", "ruler_score", "explanation"]])
        scores = [t.metrics["ruler_score"] for t in scored]
        assert all(0 <= s <= 1 for s in scores) and scores[0] == scores[4]
        assert all(t.metadata["ruler_explanation"] for t in scored)
        stats = await engine.stats()
        again = await art.ruler_score_group(
            group, judge_model, {"temperature": 0}, cache_dir=tmp_path / "cache"
        )
        assert again.rewards() == scored.rewards() and (await engine.stats())["requests"] == stats["requests"]
