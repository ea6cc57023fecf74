"""Preflight: before step 1, play one small batch and say whether the reward can teach this model anything.

GRPO learns only from differences within a group. A batch whose groups all scored alike trains nothing, and a
run of such batches advances its step counter for hours while the model stays where it was; so do rollouts that
raise, rewards that are NaN, replies cut off at `max_tokens`, or a judge whose replies cannot be parsed or whose
ranking has nothing to do with the task, and so does a chat template that drops the rollouts' tools or tool
calls (the model never sees them). Each of those shows in one batch. `preflight` plays it, scores it with
the judge when there is one, and turns what it measured into checks, each with a plain verdict and the setting
to change. The batch is kept (`report.groups`, judged when a judge was given), so a loop can train its first
step on it instead of throwing it away.

`diagnose` is the pure part: measurements in, checks out, so every verdict is tested on constructed groups.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pandas as pd
from openai.types.chat.chat_completion import Choice

from . import costs
from .capture import own_or_captured
from .compare import compare_rewards
from .contracts import InProcessJudge
from .gather import gather_trajectory_groups
from .metric_names import STEP_TRAIN_S
from .model import Model
from .ruler import DEFAULT_RUBRIC, ruler_score_group
from .tokenize import TOOLS_FIX, dropped_tool_parts
from .trajectory import Trajectory, TrajectoryGroup, dumps_json, reward_problem

Status = Literal["ok", "warn", "fail"]
Judge = str | Model | InProcessJudge
AGREEMENT_WARN = 0.3  # mean Spearman below this: the judge ranks mostly unlike the task's own reward
AGREEMENT_MIN_GROUPS = 3  # fewer groups with a rank correlation: too few to say whether the judge agrees
REPEATS_WARN = 0.5  # share of rollouts that repeat a sibling word for word
CUT_WARN = 0.1  # share of replies stopped by max_tokens


@dataclass(frozen=True)
class Check:
    """One thing preflight measured: its status, what was found, and what to change when it is not ok."""

    name: str
    status: Status
    finding: str
    advice: str = ""


@dataclass
class Batch:
    """What one preflight batch measured; `diagnose` reads only this."""

    groups: list[TrajectoryGroup]  # as the rollouts scored them
    judged: list[TrajectoryGroup] | None = (
        None  # the judge's copies, when a judge scored (failed groups absent)
    )
    judge_errors: list[str] = field(default_factory=list)  # one per group the judge could not score
    judge_label: str = ""
    rollout_s: float | None = None  # None: the groups were gathered elsewhere, untimed
    judge_s: float = 0.0
    judge_usd: float | None = None  # None: litellm has no price for the judge
    train_s: float | None = None  # seconds a train step took in this run so far; None: not yet measured
    tools_dropped: list[str] = field(
        default_factory=list
    )  # tool use the model's chat template does not render


@dataclass
class PreflightReport:
    """The checks of one batch, its groups (ready to train on), and the measured seconds."""

    checks: list[Check]
    batch: Batch

    @property
    def groups(self) -> list[TrajectoryGroup]:
        """The batch's groups as training would use them: the judge's scores when a judge was given."""
        return self.batch.judged if self.batch.judged is not None else self.batch.groups

    @property
    def ok(self) -> bool:
        """True when nothing failed: training on batches like this one can learn (warnings aside)."""
        return all(c.status != "fail" for c in self.checks)

    @property
    def verdict(self) -> str:
        """One line: ready, ready with warnings, or what stops the run from learning."""
        failed = [c for c in self.checks if c.status == "fail"]
        warned = [c for c in self.checks if c.status == "warn"]
        if failed:
            return f"cannot learn yet: {failed[0].finding}. {failed[0].advice}"
        if warned:
            return f"can learn, with {len(warned)} warning(s): " + "; ".join(c.name for c in warned)
        return "ready to train: every check passed"

    def table(self) -> pd.DataFrame:
        """The checks as a table (status, check, finding, advice)."""
        return pd.DataFrame(
            [
                {"status": c.status, "check": c.name, "finding": c.finding, "advice": c.advice}
                for c in self.checks
            ]
        )

    def __str__(self) -> str:
        marks = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}
        lines = [f"preflight: {self.verdict}"]
        for c in self.checks:
            lines.append(
                f"  {marks[c.status]} {c.name}: {c.finding}" + (f" -> {c.advice}" if c.advice else "")
            )
        return "\n".join(lines)


async def preflight(
    model: Model,
    rollout: Callable[..., Awaitable[Trajectory]],
    scenarios: Iterable[Any],
    *,
    group_size: int = 4,
    judge: Judge | None = None,
    judge_params: dict[str, Any] | None = None,
    rubric: str = DEFAULT_RUBRIC,
    **rollout_kwargs: Any,
) -> PreflightReport:
    """Play one step's batch (`group_size` rollouts of each scenario), judge it if a judge is given, and check
    whether it could train. Nothing is trained or logged; the judge's spend goes to the next history row.

    >>> report = await art.preflight(model, rollout, scenarios(0), group_size=8, judge=art.LocalJudge())
    >>> print(report)              # a verdict per check, and the settings to change
    >>> await model.train(report.groups, config=config)   # the batch can be step 0's

    Pass the scenarios of one step: the seconds per step are projected from this batch. `judge` and
    `judge_params` (more litellm arguments: api_base, api_key...) are what `art.ruler_score_group` takes;
    `rollout_kwargs` go to every rollout call.
    """
    scenarios = list(scenarios)
    if not scenarios:
        raise ValueError("preflight needs at least one scenario: pass the scenarios of one training step")
    if group_size < 2:
        raise ValueError(f"group_size={group_size}: GRPO compares rollouts, so use at least 2")
    total = len(scenarios) * group_size
    start = time.monotonic()
    groups = await gather_trajectory_groups(
        (
            TrajectoryGroup(own_or_captured(rollout(model, s, **rollout_kwargs)) for _ in range(group_size))
            for s in scenarios
        ),
        pbar_desc="preflight",
        max_exceptions=total,  # a failing rollout is a finding here, not a reason to stop
    )
    return await preflight_groups(
        groups,
        judge=judge,
        judge_params=judge_params,
        rubric=rubric,
        rollout_s=time.monotonic() - start,
        model=model,
    )


async def preflight_groups(
    groups: Iterable[TrajectoryGroup],
    *,
    judge: Judge | None = None,
    judge_params: dict[str, Any] | None = None,
    rubric: str = DEFAULT_RUBRIC,
    rollout_s: float | None = None,
    model: Model | None = None,
) -> PreflightReport:
    """`preflight`'s checks on groups gathered another way (self-play, replayed games): judged when a judge is
    given; `rollout_s` (how long they took) and `model` (whose history holds its train steps' seconds) make the
    time per step projected.

    >>> report = await art.preflight_groups(groups, judge=art.LocalJudge())
    """
    groups = list(groups)
    batch = Batch(
        groups=groups,
        rollout_s=rollout_s,
        train_s=_train_seconds(model) if model is not None else None,
        tools_dropped=_tools_dropped(model, groups) if model is not None else [],
    )
    if judge is not None:
        await _judge(batch, judge, judge_params, rubric)
    return PreflightReport(diagnose(batch), batch)


async def _judge(batch: Batch, judge: Judge, params: dict[str, Any] | None, rubric: str) -> None:
    ledger = costs.CostLedger()
    start = time.monotonic()
    with costs.activate(ledger):
        results = await asyncio.gather(
            # asked afresh: a cached answer would hide the judge's time, cost and failures
            *(ruler_score_group(g, judge, params, rubric=rubric, cache=False) for g in batch.groups),
            return_exceptions=True,
        )
    batch.judge_s = time.monotonic() - start
    batch.judged = [r for r in results if isinstance(r, TrajectoryGroup)]
    batch.judge_errors = [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]
    batch.judge_label = (
        judge.label if isinstance(judge, InProcessJudge) else str(getattr(judge, "name", judge))
    )
    spent = ledger.forward(costs.shared)  # still recorded with the next history row, like any judge call
    usd = spent.get("costs/judge/ruler/usd")
    batch.judge_usd = 0.0 if isinstance(judge, InProcessJudge) else usd


def _train_seconds(model: Model) -> float | None:
    """The mean seconds of this run's recent train steps, from its history; None before the first."""
    try:
        history = model.history()
    except Exception:  # a model with no run directory yet
        return None
    if STEP_TRAIN_S not in history.columns:
        return None
    recent = history[STEP_TRAIN_S].dropna().tail(3)
    return float(recent.mean()) if len(recent) else None


def _tools_dropped(model: Model, groups: Sequence[TrajectoryGroup]) -> list[str]:
    """The rollouts' tool use that the chat template the model trains with leaves out; [] when the model's
    backend keeps no tokenizer here (a remote one) or the model is not registered."""
    try:
        served_model = getattr(model.backend(), "served_model", None)
    except ValueError:  # not registered
        return []
    served = served_model(model) if served_model is not None else None
    if served is None:
        return []
    trajectories = [t for g in groups for t in g.trajectories]
    return dropped_tool_parts(served.tokenizer, trajectories, served.settings.chat_template_kwargs)


def diagnose(batch: Batch) -> list[Check]:
    """The checks for one measured batch, in the order a user should fix them."""
    trajectories = [t for g in batch.groups for t in g.trajectories]
    failed = [e for g in batch.groups for e in g.exceptions]
    checks = [_rollouts(len(trajectories), failed)]
    if not trajectories:
        return checks
    checks += [
        _finite_rewards(batch.groups),
        _trainable_turns(trajectories),
        _differing(batch.groups, "groups whose rewards differ", trains=batch.judged is None),
        _repeats(batch.groups),
        _cut_replies(trajectories),
    ]
    if batch.tools_dropped:
        checks.append(
            Check(
                "chat template renders the tools",
                "warn",
                f"the model's chat template drops {' and '.join(batch.tools_dropped)}, which these rollouts use, "
                "so the model does not see them (turns after a dropped tool call train off-policy)",
                TOOLS_FIX,
            )
        )
    if batch.judged is not None:
        checks += _judge_checks(batch)
    checks += [_tokens(trajectories), _seconds(batch, len(batch.groups))]
    return checks


def _rollouts(played: int, failed: Sequence[Any]) -> Check:
    name = "rollouts that finished"
    total = played + len(failed)
    if not failed:
        return Check(name, "ok", f"{played} of {total}")
    first = f"{failed[0].type}: {failed[0].message}"[:200]
    status: Status = "fail" if not played else "warn"
    return Check(
        name,
        status,
        f"{len(failed)} of {total} rollouts raised (first: {first})",
        "fix the rollout (its traceback is in group.exceptions); gather drops failed rollouts only up to "
        "max_exceptions",
    )


def _finite_rewards(groups: Sequence[TrajectoryGroup]) -> Check:
    name = "rewards are finite numbers"
    rewards = [t.reward for g in groups for t in g.trajectories]
    bad = [(r, problem) for r in rewards if (problem := reward_problem(r)) is not None]
    if bad:
        return Check(
            name,
            "fail",
            f"{len(bad)} of {len(rewards)} rewards cannot train (e.g. {bad[0][0]!r}: {bad[0][1]})",
            "return a finite reward of sensible size from every rollout (e.g. 0 for a failed game); training "
            "refuses the batch",
        )
    return Check(name, "ok", f"range {min(rewards):.3g} to {max(rewards):.3g}, mean {_mean(rewards):.3g}")


def _trainable_turns(trajectories: Sequence[Trajectory]) -> Check:
    name = "trainable turns"
    without = sum(1 for t in trajectories if t.trainable_turns() == 0)
    no_logprobs = sum(1 for t in trajectories for c in _choices(t) if c.logprobs is None)
    if without:
        return Check(
            name,
            "fail" if without == len(trajectories) else "warn",
            f"{without} of {len(trajectories)} rollouts have no trainable turn",
            "append completion.choices[0] (the Choice) to messages_and_choices, not a message dict",
        )
    if no_logprobs:
        return Check(
            name,
            "warn",
            f"{no_logprobs} replies carry no logprobs",
            "ask with logprobs=True (artnb's engines always return them), or train with "
            "allow_training_without_logprobs=True",
        )
    turns = [t.trainable_turns() for t in trajectories]
    return Check(name, "ok", f"{_mean(turns):.1f} per rollout")


def _differing(groups: Sequence[TrajectoryGroup], name: str, trains: bool = True) -> Check:
    scored = [g for g in groups if len(g.trajectories) >= 2]
    differ = [g for g in scored if _spread(g.rewards()) > 1e-9]
    finding = f"{len(differ)} of {len(scored)} groups"
    if len(scored) < len(groups):  # a group that kept < 2 rollouts is left out of training
        finding += f" ({len(groups) - len(scored)} more kept fewer than 2 finished rollouts: left out)"
    if not scored:
        return Check(
            name, "fail", "no group has two finished rollouts", "raise group_size, fix failing rollouts"
        )
    if not trains:  # the judge's scores train; the rollout's own reward is the yardstick
        return Check(
            name,
            "ok" if differ else "warn",
            f"{finding} (the judge's scores train; yours measure)",
            ""
            if differ
            else "your reward is equal within every group: it cannot tell whether the judge is right",
        )
    if not differ:
        return Check(
            name,
            "fail",
            f"{finding}: every group scored alike, so every advantage is 0 and a step trains nothing",
            "raise the temperature or the group size, or give partial credit so that better attempts score higher",
        )
    if len(differ) < len(scored) / 2:
        return Check(
            name,
            "warn",
            f"{finding}: {len(scored) - len(differ)} groups with equal rewards will train nothing",
            "raise the temperature or the group size, or give partial credit so that rewards differ more often",
        )
    return Check(name, "ok", f"{finding} (these train)")


def _repeats(groups: Sequence[TrajectoryGroup]) -> Check:
    name = "rollouts that differ from their siblings"
    total = sum(len(g.trajectories) for g in groups)
    repeats = sum(len(g.trajectories) - len({_replies(t) for t in g.trajectories}) for g in groups)
    same = sum(
        1 for g in groups if len(g.trajectories) >= 2 and len({_replies(t) for t in g.trajectories}) == 1
    )
    if repeats / max(total, 1) >= REPEATS_WARN:
        return Check(
            name,
            "warn",
            f"{repeats} of {total} rollouts repeat a sibling word for word ({same} groups all alike)",
            "sample with temperature near 1 (temperature 0 makes every rollout of a scenario the same)",
        )
    return Check(name, "ok", f"{total - repeats} of {total} distinct within their group")


def _cut_replies(trajectories: Sequence[Trajectory]) -> Check:
    name = "replies that finished"
    choices = [c for t in trajectories for c in _choices(t)]
    cut = sum(1 for c in choices if c.finish_reason == "length")
    if choices and cut / len(choices) > CUT_WARN:
        return Check(
            name,
            "warn",
            f"{cut} of {len(choices)} replies stopped at max_tokens",
            "raise max_tokens (a cut-off answer is scored, and trained, as it stands)",
        )
    return Check(name, "ok", f"{len(choices) - cut} of {len(choices)}")


def _judge_checks(batch: Batch) -> list[Check]:
    judged = batch.judged or []
    total = len(judged) + len(batch.judge_errors)
    label = batch.judge_label or "the judge"
    checks = []
    if batch.judge_errors:
        checks.append(
            Check(
                "judge replies",
                "fail" if not judged else "warn",
                f"{label} failed on {len(batch.judge_errors)} of {total} groups ({batch.judge_errors[0][:200]})",
                "check the judge's model name and key; a judge that cannot follow RULER's JSON format needs a "
                "stronger model (gather drops a group the judge fails on)",
            )
        )
    else:
        checks.append(Check("judge replies", "ok", f"{label} scored {total} of {total} groups"))
    if not judged:
        return checks
    checks.append(_differing(judged, "groups whose judge scores differ"))
    spearman = compare_rewards(judged).groups["spearman"].dropna()
    name = "judge agrees with your reward"
    if spearman.empty:
        checks.append(Check(name, "ok", "not measurable: your own reward is equal within every judged group"))
    elif len(spearman) < AGREEMENT_MIN_GROUPS:
        checks.append(
            Check(
                name,
                "warn",
                f"mean Spearman {spearman.mean():.2f} over only {len(spearman)} group(s) where your reward "
                "differs: too few to tell",
                f"preflight more scenarios (at least {AGREEMENT_MIN_GROUPS} groups whose own rewards differ) "
                "before trusting the judge's scores",
            )
        )
    elif spearman.mean() < AGREEMENT_WARN:
        checks.append(
            Check(
                name,
                "warn",
                f"mean rank correlation (Spearman) {spearman.mean():.2f} over {len(spearman)} groups",
                "read the groups where they disagree (art.widgets.RulerComparison); fix the rubric, or the "
                "reward, whichever is wrong",
            )
        )
    else:
        checks.append(Check(name, "ok", f"mean Spearman {spearman.mean():.2f} over {len(spearman)} groups"))
    return checks


def _tokens(trajectories: Sequence[Trajectory]) -> Check:
    sampled = [sum(_sampled_tokens(c) for c in _choices(t)) for t in trajectories]
    return Check("sampled tokens per rollout", "ok", f"{_mean(sampled):.0f} (max {max(sampled)})")


def _seconds(batch: Batch, n_groups: int) -> Check:
    rollout_s = batch.rollout_s or 0.0
    parts = [f"rollouts {rollout_s:.0f}s" if batch.rollout_s is not None else "rollouts: not timed here"]
    if batch.judged is not None:
        usd = batch.judge_usd
        price = "unknown (litellm has no price for it)" if usd is None else f"${usd:.4f}"
        parts.append(f"judge {batch.judge_s:.0f}s, {price}")
    known = rollout_s + batch.judge_s
    if batch.train_s is None:
        parts.append("training: measured by the first step")
        finding = f"~{known:.0f}s + training (" + "; ".join(parts) + ")"
    else:
        parts.append(f"training {batch.train_s:.0f}s (this run's recent steps)")
        finding = f"~{known + batch.train_s:.0f}s (" + "; ".join(parts) + ")"
    return Check(f"time per step of {n_groups} group{'s' if n_groups != 1 else ''}", "ok", finding)


def _choices(t: Trajectory) -> list[Choice]:
    items = list(t.messages_and_choices)
    for h in t.additional_histories:
        items += h.messages_and_choices
    return [c for c in items if isinstance(c, Choice)]


def _replies(t: Trajectory) -> str:
    """What the model said in a rollout, as one string (its replies' text and tool calls)."""
    return dumps_json([c.message.model_dump(include={"content", "tool_calls"}) for c in _choices(t)])


def _sampled_tokens(choice: Choice) -> int:
    return len(choice.logprobs.content or []) if choice.logprobs is not None else 0


def _spread(values: Sequence[float]) -> float:
    finite = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return max(finite) - min(finite) if finite else 0.0


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else math.nan
