"""RULER: rewards from an LLM judge that reads a whole group of trajectories and scores each from 0 to 1.

Why relative scoring: a judge ranks attempts at the same task side by side far more reliably than it grades
one attempt alone, and GRPO only uses the differences within a group anyway. So one call per group replaces a
hand-written reward function (`ruler_score_group`), or checks one (`compare_rewards` in compare.py).

Design choices:
- Any judge litellm reaches (`"openai/o4-mini"`, `"hosted_vllm/..."`, `"ollama/..."`), or any `art.Model`,
  such as the local base model our engine serves, which works offline with no API key. `art.LocalJudge()`
  (artnb/local_judge.py) scores offline from token probabilities instead, one attempt at a time, which a small
  model does better than writing the list; it bypasses the cache and request limits below. An `art.Model`
  judge is called through litellm's OpenAI provider at the model's endpoint, with a JSON schema made for this
  group (each id once, in order; scores in [0, 1]; short explanations), which our engines and vLLM enforce
  while decoding, so even the 135M embedded model answers with usable JSON.
- Scores are matched to trajectories by id, never by position. A reply with a missing, duplicate or unknown
  id, a score outside [0, 1] or broken JSON is sent back to the judge once, with the problem stated; a second
  bad reply is a `RulerError` naming the problem and what to change.
- The messages all trajectories start with (system prompt, task) are sent once as context; identical
  trajectories are sent once and share the score, so the judge is never asked to tell copies apart.
- Answers are cached on disk (judge_cache.py), keyed by judge, settings, rubric and exact content: re-running
  a cell costs nothing. `cache=False` turns it off. The endpoint URL is not part of the key (a local engine
  gets a new port each start); an `art.TrainableModel` judge is called at its current step (`name@step`),
  so a judge that trained since is a new key.
- Every judge request has limits of ours (`JudgeLimits`: a time bound, retries with backoff honouring
  Retry-After, a fast failure on a bad request), so one stuck judge cannot stall a training step; see
  judge_requests.py.
- `ruler_score_group` never mutates its input: it returns a new group whose reward is the judge's score (or
  `combine(independent_reward, ruler_score)`), with both numbers kept in `metrics`, the explanation in
  `metadata["ruler_explanation"]` and in `logs`.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel, ValidationError

from .cache import cache_dir as artnb_cache_dir
from .contracts import InProcessJudge
from .judge_cache import JudgeCache
from .judge_requests import JudgeLimits, RulerError, fold_litellm_limits, request_judge
from .model import Model
from .trajectory import Message, PendingGroup, TrajectoryGroup, choice_to_message, shared_prefix

log = logging.getLogger("artnb")

DEFAULT_RUBRIC = """\
- An attempt that reaches the goal of the task must score clearly above every attempt that does not.
- Among attempts that reach the goal, the more direct one (fewer wasted steps, mistakes or repeated \
actions) scores higher.
- Score gaps follow quality gaps: nearly equal attempts get nearly equal scores, a much better attempt a \
much higher score.
- An attempt that fails still earns partial credit for real progress toward the goal."""

_SYSTEM = """\
You are judging attempts by an AI agent at one and the same task. Work out what the task is from the \
conversation, especially its first system and user messages. {scope} Give each attempt a score from 0 (worst) \
to 1 (best) and a one-sentence explanation.

Grading standards:
{rubric}

Reply with JSON only, in this form: {{"scores": [{{"trajectory_id": "<id>", "explanation": "<one sentence>", \
"score": <number from 0 to 1>}}, ...]}}, with exactly one entry for each trajectory id."""

_MANY = "Compare the attempts with each other: the scores are used relative to one another."
_ONE = "There is a single attempt: score it on its own merits against the goal."

EXPLANATION_MAX_CHARS = 240  # bounds what a schema-constrained judge writes per trajectory
_NOT_IN_KEY = {"api_key", "api_base", "base_url", "extra_headers"}  # limits never reach the key either


class TrajectoryScore(BaseModel):
    trajectory_id: str
    explanation: str
    score: float


class RulerResponse(BaseModel):
    """One entry per trajectory id: a short explanation, then a score from 0 to 1."""

    scores: list[TrajectoryScore]


class _LenientScore(TrajectoryScore):
    trajectory_id: str | int  # some judges write ids as numbers


class _LenientResponse(BaseModel):
    scores: list[_LenientScore]


class _Unusable(ValueError):
    pass


async def ruler(
    message_lists: Iterable[Sequence[Message]],
    judge_model: str | Model | InProcessJudge,
    extra_litellm_params: dict[str, Any] | None = None,
    rubric: str = DEFAULT_RUBRIC,
    tools: list[dict[str, Any]] | None = None,
    *,
    cache: bool = True,
    cache_dir: str | Path | None = None,
    debug: bool = False,
    limits: JudgeLimits = JudgeLimits(),  # noqa: B008 (frozen, so one shared default is safe)
) -> list[TrajectoryScore]:
    """Score conversations that attempt the same task, relative to each other, with an LLM judge.

    Returns one `TrajectoryScore` per message list, in input order, `trajectory_id` being its 1-based position.

    Example:
        scores = await art.ruler([t.messages() for t in group], "openai/o4-mini")

    judge_model: a litellm model string, an `art.Model` / `art.TrainableModel` (its endpoint is used), or an
        `art.LocalJudge()`, which runs in this process (no cache, no requests, no limits needed).
    extra_litellm_params: more `litellm.acompletion` arguments (api_base, api_key, temperature...). Its
        `timeout` (seconds) replaces `limits.timeout_s`, and its `num_retries` (else `max_retries`) = n sets
        `limits.max_attempts` to n + 1, as code written for litellm expects; setting the same thing in both
        places is a ValueError. litellm itself always gets `num_retries=0, max_retries=0`.
    tools: tool definitions the agent had, shown to the judge.
    cache / cache_dir: reuse answers stored on disk (see judge_cache.py); `cache=False` always asks the judge.
    debug: print the judge's replies (retries are logged as warnings either way).
    limits: time limit per request, retries and backoff (`JudgeLimits`). A reply that is unusable (broken JSON,
        missing or unknown ids...) is not a failed attempt: it earns one more request showing the judge the
        problem, with the attempts that remain (at least one), so at most `max_attempts + 1` requests are sent.

    Raises `JudgeRequestError` when the judge cannot be reached or refuses the request, `RulerError` when its
    second reply is still unusable.
    """
    limits, extra_litellm_params = fold_litellm_limits(limits, extra_litellm_params)
    lists = [[_plain(m) for m in messages] for messages in message_lists]
    if not lists:
        return []
    unique: dict[str, int] = {}  # canonical JSON of a conversation -> its judge id (1-based)
    judge_ids = [unique.setdefault(_canonical(messages), len(unique) + 1) for messages in lists]
    distinct = [lists[judge_ids.index(i)] for i in range(1, len(unique) + 1)]
    ids = [str(i) for i in range(1, len(distinct) + 1)]
    if isinstance(judge_model, InProcessJudge):
        found = await judge_model.score(distinct, rubric, tools)
        return [
            TrajectoryScore(trajectory_id=str(n + 1), explanation=found[j - 1][1], score=found[j - 1][0])
            for n, j in enumerate(judge_ids)
        ]
    params, identity, constrained = await _judge_params(judge_model, extra_litellm_params)
    messages = [
        {"role": "system", "content": _SYSTEM.format(scope=_MANY if len(ids) > 1 else _ONE, rubric=rubric)},
        {"role": "user", "content": _user_prompt(distinct, tools)},
    ]
    response_format: Any = _schema_for(ids) if constrained else RulerResponse
    schema = response_format if constrained else RulerResponse.model_json_schema()
    store = JudgeCache(cache_dir or artnb_cache_dir("ruler")) if cache else None
    key = JudgeCache.key({"judge": identity, "messages": messages, "schema": schema})
    by_id: dict[str, TrajectoryScore] | None = None
    if store is not None and (cached := store.get(key)) is not None:
        try:
            by_id = _parse(json.dumps({"scores": cached}), ids)
            if debug:
                print(f"[RULER] cached answer of {params['model']}: {store.path(key)}")
        except _Unusable:
            by_id = None
    if by_id is None:
        by_id = await _ask_judge(params, messages, response_format, ids, limits, debug)
        if store is not None:
            store.put(key, [by_id[i].model_dump() for i in ids])
    return [
        TrajectoryScore(
            trajectory_id=str(n + 1), explanation=by_id[str(j)].explanation, score=by_id[str(j)].score
        )
        for n, j in enumerate(judge_ids)
    ]


async def ruler_score_group(
    group: TrajectoryGroup,
    judge_model: str | Model | InProcessJudge,
    extra_litellm_params: dict[str, Any] | None = None,
    rubric: str = DEFAULT_RUBRIC,
    *,
    combine: Callable[[float, float], float] | None = None,
    swallow_exceptions: bool = False,
    debug: bool = False,
    cache: bool = True,
    cache_dir: str | Path | None = None,
    limits: JudgeLimits = JudgeLimits(),  # noqa: B008 (frozen, so one shared default is safe)
) -> TrajectoryGroup | None:
    """A copy of `group` whose rewards are the judge's relative scores; the input group is left as it was.

    Each trajectory keeps its rollout reward in `metrics["independent_reward"]` (the first one, if the group
    was scored before) and the judge's score in `metrics["ruler_score"]`; its reward becomes the score, or
    `combine(independent_reward, ruler_score)`. The explanation goes to `metadata["ruler_explanation"]` and logs.

    Example, scoring every group as it finishes; a group the judge fails on (after the retries `limits`
    allows) is left out, counted in `groups.after_each_failures`, and the other groups are kept:
        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(model, s) for _ in range(8)) for s in scenarios),
            after_each=lambda g: art.ruler_score_group(g, "openai/o4-mini"),
        )

    combine: e.g. `lambda independent, ruler: ruler + 0.5 * independent` to keep part of the rollout's reward.
    swallow_exceptions: on any error, log a warning and return None (gather then drops the group, uncounted).
    limits: time limit per judge request, retries and backoff; see `JudgeLimits` and `ruler`.
    Other arguments as in `ruler`.
    """
    _check_group(group)  # before the try: swallow_exceptions is for judge failures, not a wrong argument
    try:
        for i, t in enumerate(group.trajectories):
            if t.additional_histories:
                raise ValueError(
                    f"trajectory {i} has additional_histories, which RULER does not score: score such groups "
                    "with your own reward, or move the extra conversation into the trajectory's messages"
                )
        scored = group.model_copy(deep=True)
        if not scored.trajectories:
            return scored
        tools = next((t.tools for t in scored.trajectories if t.tools), None)
        scores = await ruler(
            [t.messages() for t in scored.trajectories],
            judge_model,
            extra_litellm_params,
            rubric,
            tools,
            cache=cache,
            cache_dir=cache_dir,
            debug=debug,
            limits=limits,
        )
    except Exception as error:
        if not swallow_exceptions:
            raise
        log.warning("RULER could not score a group of %d; dropping it: %s", len(group.trajectories), error)
        return None
    for t, s in zip(scored.trajectories, scores, strict=True):
        independent = float(t.metrics.get("independent_reward", t.reward))
        t.metrics["independent_reward"] = independent
        t.metrics["ruler_score"] = s.score
        t.reward = combine(independent, s.score) if combine is not None else s.score
        t.metadata["ruler_explanation"] = s.explanation
        t.log(f"RULER score {s.score:.3g}: {s.explanation}")
    return scored


def _check_group(group: object) -> None:
    """A TypeError naming the fix when `group` is not a finished TrajectoryGroup (a list, an unawaited group)."""
    if isinstance(group, TrajectoryGroup):
        return
    if isinstance(group, PendingGroup):
        fix = "await it first (group = await art.TrajectoryGroup(...)), or score groups as they finish with "
        fix += "art.gather_trajectory_groups(..., after_each=lambda g: art.ruler_score_group(g, judge))"
    elif isinstance(group, (list, tuple)):
        fix = "wrap the trajectories in art.TrajectoryGroup([...])"
    else:
        fix = "pass art.TrajectoryGroup([...]) holding the trajectories to compare"
    raise TypeError(f"ruler_score_group scores a TrajectoryGroup (got {type(group).__name__}); {fix}")


async def _judge_params(judge: str | Model, extra: dict[str, Any] | None) -> tuple[dict[str, Any], str, bool]:
    """litellm arguments, the judge's identity for the cache key, and whether it enforces our JSON schema."""
    extra = dict(extra or {})
    if isinstance(judge, str):
        settings = {k: v for k, v in extra.items() if k not in _NOT_IN_KEY}
        return {"model": judge, **extra}, json.dumps([judge, settings], sort_keys=True, default=str), False
    if not isinstance(judge, Model):
        raise TypeError(
            f"judge_model must be a litellm model string or an art.Model, got {type(judge).__name__}"
        )
    if not judge.inference_base_url:
        raise ValueError(
            f"judge model {judge.name!r} has no inference_base_url: register it with a backend first, or "
            "create it as art.Model(name=..., inference_base_url=..., inference_model_name=...)"
        )
    name = judge.get_inference_name(await judge.get_step() if judge.trainable else None)
    params = {
        "model": f"openai/{name}",
        "api_base": judge.inference_base_url,
        "api_key": judge.inference_api_key or "none",
        **extra,
    }
    settings = {k: v for k, v in extra.items() if k not in _NOT_IN_KEY}
    return params, json.dumps([f"openai/{name}", settings], sort_keys=True, default=str), True


def _schema_for(ids: list[str]) -> dict[str, Any]:
    """An OpenAI `response_format` allowing exactly one score per id, in order, each in [0, 1]."""
    items = [
        {
            "type": "object",
            "properties": {
                "trajectory_id": {"const": i},
                "explanation": {"type": "string", "maxLength": EXPLANATION_MAX_CHARS},
                "score": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["trajectory_id", "explanation", "score"],
            "additionalProperties": False,
        }
        for i in ids
    ]
    array = {
        "type": "array",
        "prefixItems": items,
        "items": False,
        "minItems": len(ids),
        "maxItems": len(ids),
    }
    schema = {
        "type": "object",
        "properties": {"scores": array},
        "required": ["scores"],
        "additionalProperties": False,
    }
    return {"type": "json_schema", "json_schema": {"name": "ruler_scores", "schema": schema, "strict": True}}


async def _ask_judge(
    params: dict[str, Any],
    messages: list[dict[str, Any]],
    response_format: Any,
    ids: list[str],
    limits: JudgeLimits,
    debug: bool,
) -> dict[str, TrajectoryScore]:
    """The judge's scores; an unusable reply is shown to the judge once, with the attempts that remain."""
    messages = list(messages)
    content, sent = await request_judge(params, messages, response_format, limits, limits.max_attempts)
    for corrected in (False, True):
        if debug:
            print(f"[RULER] judge {params['model']} reply (request {sent}):\n{content}")
        try:
            return _parse(content, ids)
        except _Unusable as problem:
            if corrected:
                raise RulerError(
                    f"the judge {params['model']} gave unusable scores twice ({problem}). Use a judge that "
                    "follows response_format (an art.Model on our engines or vLLM enforces it), score smaller "
                    "groups, or look at the replies with debug=True"
                ) from None
            messages += [
                {"role": "assistant", "content": content},
                {
                    "role": "user",
                    "content": f"Your reply could not be used: {problem}. Reply again with JSON only: exactly one "
                    f"entry for each trajectory id ({', '.join(ids)}), each id once, every score from 0 to 1.",
                },
            ]
            remaining = max(1, limits.max_attempts - sent + 1)
            content, more = await request_judge(params, messages, response_format, limits, remaining, sent)
            sent += more
    raise AssertionError("unreachable")


_FENCE = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)


def _parse(content: str, ids: list[str]) -> dict[str, TrajectoryScore]:
    """The judge's scores by id; raises _Unusable describing every problem found."""
    if not content.strip():
        raise _Unusable("the reply was empty")
    fenced = _FENCE.match(content)
    try:
        reply = _LenientResponse.model_validate_json(fenced.group(1) if fenced else content)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(map(str, first["loc"]))
        raise _Unusable(f"the reply is not the requested JSON ({where}: {first['msg']})") from None
    by_id: dict[str, TrajectoryScore] = {}
    seen: set[str] = set()
    problems = []
    for s in reply.scores:
        key = str(s.trajectory_id).strip()
        if key not in ids:
            problems.append(f"trajectory id {key!r} does not exist")
        elif key in seen:
            problems.append(f"trajectory id {key} is scored more than once")
        elif not (math.isfinite(s.score) and 0 <= s.score <= 1):
            problems.append(f"the score {s.score} for trajectory {key} is outside 0 to 1")
        else:
            by_id[key] = TrajectoryScore(trajectory_id=key, explanation=s.explanation, score=float(s.score))
        seen.add(key)
    missing = [i for i in ids if i not in seen]
    if missing:
        problems.append(f"no score for trajectory id{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
    if problems:
        raise _Unusable("; ".join(problems))
    return by_id


def _user_prompt(distinct: list[list[Message]], tools: list[dict[str, Any]] | None) -> str:
    shared = shared_prefix(distinct) if len(distinct) > 1 else 0
    parts = []
    if shared:
        parts.append(f"<context>\n{_render(distinct[0][:shared])}\n</context>")
    if tools:
        parts.append(f"<tools>\n{json.dumps(tools, ensure_ascii=False, default=str)}\n</tools>")
    if shared:
        parts.append("Every trajectory below starts with the context above and continues as shown.")
    parts += [
        f'<trajectory id="{i}">\n{_render(messages[shared:])}\n</trajectory>'
        for i, messages in enumerate(distinct, start=1)
    ]
    return "\n\n".join(parts)


def _render(messages: list[Message]) -> str:
    """One JSON message per line: compact, unambiguous, and easy for a small judge to follow."""
    if not messages:
        return "[]"
    return "[\n" + ",\n".join(json.dumps(m, ensure_ascii=False, default=str) for m in messages) + "\n]"


def _plain(message: Any) -> Message:
    if isinstance(message, dict):
        return message
    if isinstance(message, Choice):
        return choice_to_message(message)
    if isinstance(message, BaseModel):
        return message.model_dump(exclude_none=True)
    raise TypeError(
        f"ruler takes lists of OpenAI message dicts, got {type(message).__name__}: pass trajectory.messages()"
    )


def _canonical(messages: list[Message]) -> str:
    return json.dumps(messages, sort_keys=True, ensure_ascii=False, default=str)
