"""RULER's limits on its judge, through the public API, against a real local server that misbehaves on purpose.

The judge is fake_openai.FakeJudge (a uvicorn server speaking OpenAI's protocol) reached through litellm as
any hosted judge is: it hangs, trickles bytes, answers 429 with Retry-After, 5xx, an HTML page, or 400/401.
Limits are small here (tenths of a second) so the whole file runs in seconds; times are asserted as bounds
with a wide margin, never as exact values.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "core"))  # fake_openai.py lives beside test_ruler.py

from fake_openai import (  # noqa: E402
    FakeJudge,
    garbage,
    good,
    hang,
    malformed,
    no_choices,
    only_for,
    rate_limited,
    refused,
    server_error,
    trickle,
)

import artnb as art  # noqa: E402
from artnb import JudgeLimits, JudgeRequestError, RulerError  # noqa: E402

JUDGE = "openai/judge"
QUICK = JudgeLimits(timeout_s=5, max_attempts=3, backoff_initial_s=0.05, backoff_max_s=0.1)
STUCK = JudgeLimits(timeout_s=0.5, max_attempts=3, backoff_initial_s=0.05, backoff_max_s=0.1)


def conversation(points: int) -> list[dict]:
    return [
        {"role": "system", "content": "You play a counting game. Reach 10 points."},
        {"role": "user", "content": "Start counting."},
        {"role": "assistant", "content": f"I reached points={points}"},
    ]


def make_group(points: list[int]) -> art.TrajectoryGroup:
    return art.TrajectoryGroup(
        art.Trajectory(messages_and_choices=conversation(p), reward=p / 100) for p in points
    )


@pytest.fixture(scope="module")
async def judge():
    """The server, after one call that warms litellm up: its first call loads provider modules for a second or
    more, which would count against these tests' tenth-of-a-second timeouts."""
    with FakeJudge() as server:
        params = {"api_base": server.url, "api_key": "test-key"}
        await art.ruler([conversation(1)], JUDGE, params, cache=False, limits=JudgeLimits(timeout_s=60))
        yield server


@pytest.fixture
def fresh(judge, tmp_path):
    """The judge with an empty script and log, answering well by default; litellm arguments and a fresh cache."""
    judge.script.clear()
    judge.requests.clear()
    judge.arrivals.clear()
    judge.default = good
    return {"api_base": judge.url, "api_key": "test-key"}, tmp_path / "cache"


def gaps(judge: FakeJudge) -> list[float]:
    return [b - a for a, b in zip(judge.arrivals, judge.arrivals[1:], strict=False)]


async def test_a_hanging_judge_is_abandoned_at_the_timeout_and_asked_again(judge, fresh):
    params, cache = fresh
    judge.script.extend([hang, good])
    limits = JudgeLimits(timeout_s=1, backoff_initial_s=0.05)
    start = time.monotonic()
    group = await art.ruler_score_group(make_group([3, 8]), JUDGE, params, cache_dir=cache, limits=limits)
    elapsed = time.monotonic() - start
    assert group.rewards() == [0.3, 0.8] and len(judge.requests) == 2
    assert 1 <= elapsed < 5, "the first request must be given up after timeout_s, not litellm's 600 s"


@pytest.mark.parametrize("stall", [hang, trickle], ids=["hang", "trickle-after-headers"])
async def test_a_judge_that_never_finishes_fails_clearly_within_the_limits(judge, fresh, stall):
    params, cache = fresh
    judge.default = stall
    start = time.monotonic()
    with pytest.raises(JudgeRequestError) as info:
        await art.ruler([conversation(1), conversation(2)], JUDGE, params, cache_dir=cache, limits=STUCK)
    elapsed = time.monotonic() - start
    # 3 attempts of 0.5 s and two waits of at most 0.1 s: about 1.7 s. No more than 3 requests may arrive
    # (litellm's hidden retries would send 9); fewer only if the machine is so loaded that one never left.
    assert 3 * 0.5 <= elapsed < 8 and 1 <= len(judge.requests) <= 3
    message = str(info.value)
    assert f"{JUDGE} at {judge.url} failed 3 attempts" in message
    assert "no reply within 0.5 s (JudgeLimits.timeout_s)" in message
    assert "JudgeLimits" in message and "swallow_exceptions=True" in message
    assert info.value.attempts == 3 and isinstance(info.value, RulerError)
    assert not list(cache.rglob("*.json")), "nothing is cached for a failed call"


async def test_swallowed_judge_failure_returns_none_and_leaves_the_group(judge, fresh):
    params, cache = fresh
    judge.default = hang
    group = make_group([1, 2])
    before = group.model_dump()
    limits = JudgeLimits(timeout_s=0.5, max_attempts=1)
    scored = await art.ruler_score_group(
        group, JUDGE, params, swallow_exceptions=True, cache_dir=cache, limits=limits
    )
    assert scored is None and group.model_dump() == before and len(judge.requests) <= 1


@pytest.mark.parametrize(
    ("retry_after", "backoff_max_s", "least", "most"),
    [("1", 5.0, 0.95, 2.5), (None, 5.0, 0.0, 0.9), ("100", 0.3, 0.25, 1.5)],
    ids=["retry-after-1", "no-header-uses-backoff", "retry-after-capped-by-backoff_max_s"],
)
async def test_a_rate_limited_judge_is_asked_again_after_retry_after(
    judge, fresh, retry_after, backoff_max_s, least, most
):
    params, cache = fresh
    judge.script.extend([rate_limited(retry_after), good])
    limits = JudgeLimits(timeout_s=5, backoff_initial_s=0.01, backoff_max_s=backoff_max_s, jitter=False)
    scores = await art.ruler(
        [conversation(4), conversation(6)], JUDGE, params, cache_dir=cache, limits=limits
    )
    assert [s.score for s in scores] == [0.4, 0.6] and len(judge.requests) == 2
    (gap,) = gaps(judge)
    assert least <= gap < most


async def test_server_errors_are_retried_with_growing_waits_then_succeed(judge, fresh):
    params, cache = fresh
    judge.script.extend([server_error(500), server_error(503), good])
    limits = JudgeLimits(timeout_s=5, max_attempts=3, backoff_initial_s=0.15, jitter=False)
    scores = await art.ruler(
        [conversation(2), conversation(9)], JUDGE, params, cache_dir=cache, limits=limits
    )
    assert [s.score for s in scores] == [0.2, 0.9] and len(judge.requests) == 3
    first, second = gaps(judge)
    assert 0.15 <= first < 1 and 0.3 <= second < 1.5, "waits double from backoff_initial_s"


async def test_server_errors_past_the_limit_name_the_last_failure(judge, fresh):
    params, cache = fresh
    judge.default = server_error(503)
    with pytest.raises(JudgeRequestError, match="failed 3 attempts .* the last: HTTP 503: .*overloaded"):
        await art.ruler([conversation(1)], JUDGE, params, cache_dir=cache, limits=QUICK)
    assert len(judge.requests) == 3


async def test_an_html_page_instead_of_json_is_retried_and_then_reported(judge, fresh):
    params, cache = fresh
    judge.script.append(garbage)
    scores = await art.ruler([conversation(5)], JUDGE, params, cache_dir=cache, limits=QUICK)
    assert [s.score for s in scores] == [0.5] and len(judge.requests) == 2
    judge.default = garbage
    limits = QUICK.model_copy(update={"max_attempts": 2})
    with pytest.raises(JudgeRequestError, match="failed 2 attempts .*502 Bad Gateway"):
        await art.ruler([conversation(6)], JUDGE, params, cache_dir=cache, limits=limits)
    assert len(judge.requests) == 4


async def test_a_reply_without_choices_is_retried_and_then_reported(judge, fresh):
    params, cache = fresh
    judge.script.append(no_choices)
    scores = await art.ruler([conversation(5)], JUDGE, params, cache_dir=cache, limits=QUICK)
    assert [s.score for s in scores] == [0.5] and len(judge.requests) == 2
    judge.default = no_choices
    limits = QUICK.model_copy(update={"max_attempts": 2})
    with pytest.raises(JudgeRequestError, match="failed 2 attempts .*empty `choices` list"):
        await art.ruler([conversation(6)], JUDGE, params, cache_dir=cache, limits=limits)


@pytest.mark.parametrize("status", [400, 401])
async def test_a_refused_request_fails_at_once_with_the_judges_message(judge, fresh, status):
    params, cache = fresh
    judge.default = refused(status)
    limits = JudgeLimits(max_attempts=5, backoff_initial_s=2, jitter=False)  # a retry would wait 2 s
    start = time.monotonic()
    with pytest.raises(JudgeRequestError) as info:
        await art.ruler([conversation(1)], JUDGE, params, cache_dir=cache, limits=limits)
    assert time.monotonic() - start < 1.5 and len(judge.requests) == 1
    message = str(info.value)
    assert f"refused the request (HTTP {status}" in message and "Not retried" in message
    assert (
        "Incorrect API key provided" if status == 401 else "Invalid value for 'response_format'"
    ) in message
    assert info.value.attempts == 1


async def test_an_unusable_reply_gets_one_extra_request_not_another_round_of_attempts(judge, fresh):
    params, cache = fresh
    lists = [conversation(3), conversation(7)]
    limits = JudgeLimits(timeout_s=5, max_attempts=3, backoff_initial_s=0.01)
    judge.script.extend([server_error(500), malformed, server_error(500), good])
    scores = await art.ruler(lists, JUDGE, params, cache_dir=cache, limits=limits)
    assert [s.score for s in scores] == [0.3, 0.7] and len(judge.requests) == 4
    assert "could not be used" in judge.requests[-1]["messages"][-1]["content"]
    judge.requests.clear()
    judge.script.extend([server_error(500), malformed])
    judge.default = server_error(500)
    with pytest.raises(JudgeRequestError, match="failed 4 attempts"):
        await art.ruler(lists, JUDGE, params, cache=False, limits=limits)
    assert len(judge.requests) == limits.max_attempts + 1


async def test_litellm_style_timeout_and_retries_in_extra_params_become_the_limits(judge, fresh):
    params, cache = fresh
    judge.default = hang
    legacy = {**params, "timeout": 0.5, "num_retries": 1}
    start = time.monotonic()
    with pytest.raises(JudgeRequestError, match="failed 2 attempts .* no reply within 0.5 s"):
        await art.ruler([conversation(1)], JUDGE, legacy, cache_dir=cache)
    assert time.monotonic() - start < 5 and 1 <= len(judge.requests) <= 2
    with pytest.raises(ValueError, match="timeout_s set twice"):
        await art.ruler([conversation(1)], JUDGE, legacy, cache_dir=cache, limits=JudgeLimits(timeout_s=5))
    with pytest.raises(ValueError, match="must be a number of seconds"):
        await art.ruler([conversation(1)], JUDGE, {**params, "timeout": "soon"}, cache_dir=cache)


class DroppingJudge:
    """A socket on 127.0.0.1 that reads each request and closes the connection without a byte of answer, as a
    judge behind a crashing proxy or a reset load balancer does. `arrivals` holds each connection's time."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/v1"
        self.arrivals: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            self.arrivals.append(time.monotonic())
            with conn:
                conn.settimeout(5)
                conn.recv(65536)  # the request's head: then hang up

    def __enter__(self) -> DroppingJudge:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.listener.close()


async def test_a_dropped_connection_is_retried_with_backoff_then_reported(judge, fresh):
    _, cache = fresh
    limits = JudgeLimits(timeout_s=5, max_attempts=3, backoff_initial_s=0.2, jitter=False)
    with DroppingJudge() as dropping:
        params = {"api_base": dropping.url, "api_key": "test-key"}
        start = time.monotonic()
        with pytest.raises(JudgeRequestError) as info:
            await art.ruler([conversation(1), conversation(2)], JUDGE, params, cache_dir=cache, limits=limits)
        elapsed = time.monotonic() - start
    assert info.value.attempts == 3 and len(dropping.arrivals) == 3  # retried, and litellm added none
    # litellm reports a connection the server closed as an HTTP 500 "Connection error"; artnb says what it was
    assert "failed 3 attempts" in str(info.value) and "connection failed" in str(info.value)
    first, second = (b - a for a, b in zip(dropping.arrivals, dropping.arrivals[1:], strict=False))
    assert 0.2 <= first and 0.4 <= second and elapsed < 5, "waits double from backoff_initial_s"


def scored_by_judge(params: dict, cache: Path):
    return lambda g: art.ruler_score_group(g, JUDGE, params, cache_dir=cache, limits=QUICK)


async def rollout(points: int) -> art.Trajectory:
    return art.Trajectory(messages_and_choices=conversation(points), reward=points / 100)


def pending_groups() -> list:
    """Three groups; the judge is made to fail on the middle one, whose trajectory says points=77."""
    return [
        art.TrajectoryGroup([rollout(1 + k), rollout(77 if k == 1 else 4 + k)], metadata={"scenario": k})
        for k in range(3)
    ]


async def test_gather_drops_the_group_its_judge_failed_on_and_keeps_the_others(judge, fresh, caplog, capsys):
    params, cache = fresh
    judge.default = only_for("points=77", server_error(500))
    with caplog.at_level(logging.WARNING, logger="artnb"):
        groups = await art.gather_trajectory_groups(
            pending_groups(), after_each=scored_by_judge(params, cache)
        )
    assert isinstance(groups, list) and [g.rewards() for g in groups] == [[0.1, 0.4], [0.3, 0.6]]
    assert [g.metadata["scenario"] for g in groups] == [0, 2]
    (failure,) = groups.after_each_failures
    assert failure.group_index == 1 and failure.error.type == "JudgeRequestError"
    assert "failed 3 attempts" in failure.error.message and "HTTP 500" in failure.error.message
    assert "after_each failed on group 1 (metadata {'scenario': 1}); leaving it out" in caplog.text
    assert "after_each_errors=1" in capsys.readouterr().err


async def test_gather_can_keep_the_group_unscored_and_marked(judge, fresh):
    params, cache = fresh
    judge.default = only_for("points=77", refused(401))
    groups = await art.gather_trajectory_groups(
        pending_groups(), after_each=scored_by_judge(params, cache), after_each_errors="keep"
    )
    assert [g.metadata["scenario"] for g in groups] == [0, 1, 2]
    scored, kept = [groups[0], groups[2]], groups[1]
    assert [g.rewards() for g in scored] == [[0.1, 0.4], [0.3, 0.6]]
    assert all("ruler_score" in t.metrics for g in scored for t in g)
    assert sorted(kept.rewards()) == [0.02, 0.77], "kept as the rollouts returned it"
    assert not any("ruler_score" in t.metrics for t in kept)
    assert kept.metrics["after_each_error"] == 1 and "after_each_error" not in groups[0].metrics
    assert "JudgeRequestError" in kept.logs[-1] and "Incorrect API key provided" in kept.logs[-1]
    assert [f.group_index for f in groups.after_each_failures] == [1]


async def test_gather_raises_the_judge_error_when_asked_to(judge, fresh):
    params, cache = fresh
    judge.default = only_for("points=77", refused(400))
    with pytest.raises(JudgeRequestError, match="HTTP 400"):
        await art.gather_trajectory_groups(
            pending_groups(), after_each=scored_by_judge(params, cache), after_each_errors="raise"
        )


async def test_a_judge_without_an_api_key_fails_at_once_and_says_which_key(judge, fresh, monkeypatch):
    params, cache = fresh
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    no_key = {k: v for k, v in params.items() if k != "api_key"}
    limits = JudgeLimits(max_attempts=5, backoff_initial_s=2, jitter=False)  # a retry would wait 2 s
    start = time.monotonic()
    with pytest.raises(JudgeRequestError, match="no API key for this judge .*OPENAI_API_KEY") as info:
        await art.ruler([conversation(1)], JUDGE, no_key, cache_dir=cache, limits=limits)
    assert time.monotonic() - start < 1.5 and info.value.attempts == 1
