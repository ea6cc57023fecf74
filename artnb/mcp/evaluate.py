"""Base vs trained on held-out MCP scenarios: each policy works each task with its own fresh server, and the
judge ranks all the answers to a task in one RULER group (`autorl.judge_side_by_side`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..autorl import Evaluation, Policy, judge_side_by_side
from ..core.contracts import InProcessJudge
from ..core.model import Model, TrainableModel
from ..core.ruler import DEFAULT_RUBRIC
from ..core.trajectory import Trajectory
from .agent import run_agent
from .connection import connect
from .types import GeneratedScenario

Server = tuple[str, Sequence[str]] | Callable[[], tuple[str, Sequence[str]]]


async def evaluate(
    model: TrainableModel,
    scenarios: Sequence[GeneratedScenario],
    judge: str | Model | InProcessJudge,
    server: Server,
    *,
    policies: Mapping[str, Policy] | None = None,
    samples: int = 1,
    rubric: str = DEFAULT_RUBRIC,
    **agent_options: Any,
) -> Evaluation:
    """`server`: (command, args) as `python_server` gives, or a function returning one per rollout (e.g. a fresh
    database each time). `agent_options` go to `run_agent` (max_turns, max_tokens, temperature, tool_choice).
    policies default to {"base": model.as_base_model(), "trained": None}; see `autorl.evaluate`."""

    async def answer(target: Model, step: int | None, scenario: GeneratedScenario) -> Trajectory:
        command, args = server() if callable(server) else server
        async with connect(command, args) as connection:
            return await run_agent(target, scenario.task, connection, step=step, **agent_options)

    return await judge_side_by_side(
        model, scenarios, judge, answer, policies=policies, samples=samples, rubric=rubric
    )
