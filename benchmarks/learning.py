"""Does training help? Train on a task for N steps, then play the same evaluation games with the base model and
the trained model, and print both with their ratio. Also prints seconds per RL step (rollouts, training),
which is how the engines are compared on a whole loop (`--engine vllm` against `--engine hf`).

Baseline: the base model (the same engine, no adapter) on the same evaluation scenarios, played greedily.

    python benchmarks/learning.py --task tic_tac_toe --steps 12
    python benchmarks/learning.py --task 2048 --steps 8 --engine hf
    python benchmarks/learning.py --task temporal_clue --steps 12
    python benchmarks/learning.py --task art_e --steps 8        # the notebook's quick inboxes: 12 emails, 2 turns
    python benchmarks/learning.py --task codenames --steps 8    # self-play: four roles' groups per board
    python benchmarks/learning.py --task auto_rl --steps 8      # scenarios written by the model, RULER rewards

Every tutorial's task is here. Two differ from "a rollout per scenario, scored by the game":
- codenames: each board is played `--group-size` times by the model in all four roles, and each (board, team,
  role) is a group (`codenames.self_play_groups`); evaluation puts the trained model against the base one on
  held-out boards (`codenames.head_to_head`, greedy, each board once as each colour), so `win` is the trained
  model's win rate against its own base (the rest are the base's wins and draws).
- auto_rl: the base model writes the scenarios from the notebook's task description (a third held out), the
  offline judge `art.LocalJudge()` is the only reward, and `artnb.autorl.evaluate` judges base and trained
  answers to each held-out scenario in one group. Its metric is that judge's score, so it says the judge
  prefers the trained answers, not that a person would.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import random
import shutil
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # runs from a checkout without `pip install -e .`
import artnb as art  # noqa: E402
from artnb import autorl  # noqa: E402
from artnb.tasks import codenames, email_agent, game_2048, temporal_clue, tic_tac_toe  # noqa: E402

AUTO_RL_TASK = "Write a one-sentence, friendly reply to a customer's complaint."  # the notebook's
AUTO_RL_EXAMPLES = ["My order arrived two weeks late and nobody answered my emails."]

Groups = Callable[[art.TrainableModel, int], Awaitable[list[art.TrajectoryGroup]]]
Evaluation = Callable[[art.TrainableModel], Awaitable[dict[str, tuple[float, float]]]]


@dataclass
class Task:
    """How one task trains and is judged: the groups of a step, and metric -> (base, trained) on held-out play."""

    groups: Groups
    evaluate: Evaluation
    description: str


def base_and_trained(table: pd.DataFrame, metrics: list[str]) -> dict[str, tuple[float, float]]:
    """metric -> (the base model's mean, the trained model's) from an evaluation table labelled base/trained."""
    summary = art.summarize_evaluation(table, metrics)
    return {m: (summary.loc["base", (m, "mean")], summary.loc["trained", (m, "mean")]) for m in metrics}


def played_task(rollout: Callable, metrics: list[str], settings: art.tutorial.Settings) -> Task:
    """A task whose rollout plays one scenario and scores it itself: the tutorials' games and ART·E."""

    async def groups(model: art.TrainableModel, step: int) -> list[art.TrajectoryGroup]:
        return await art.gather_trajectory_groups(
            art.TrajectoryGroup(rollout(model, s) for _ in range(settings.group_size))
            for s in settings.scenarios(step)
        )

    async def evaluate(model: art.TrainableModel) -> dict[str, tuple[float, float]]:
        table = await art.evaluate(
            rollout,
            {"base": model.as_base_model(), "trained": model},
            settings.evaluation_scenarios(),
            temperature=0,
        )
        return base_and_trained(table, metrics)

    return Task(groups, evaluate, f"evaluation: {settings.eval_scenarios} games each")


def codenames_task(settings: art.tutorial.Settings, max_turns: int) -> Task:
    metrics = ["win", "margin", "valid_clue_rate", "guess_accuracy", "own_words_found"]

    async def groups(model: art.TrainableModel, step: int) -> list[art.TrajectoryGroup]:
        return await codenames.self_play_groups(
            model, settings.scenarios(step), games_per_scenario=settings.group_size, max_turns=max_turns
        )

    async def evaluate(model: art.TrainableModel) -> dict[str, tuple[float, float]]:
        table = await codenames.head_to_head(
            {"trained": model, "base": model.as_base_model()},
            settings.evaluation_scenarios(),
            max_turns=max_turns,
        )
        return base_and_trained(table, metrics)

    return Task(
        groups,
        evaluate,
        f"{max_turns} team turns a game; evaluation: trained against base on {settings.eval_scenarios} boards, "
        "each played once as each colour",
    )


async def auto_rl_task(
    settings: art.tutorial.Settings, model: art.TrainableModel, n_scenarios: int, max_tokens: int
) -> Task:
    scenarios = await autorl.generate_scenarios(
        AUTO_RL_TASK,
        n_scenarios,
        model=model.as_base_model(),
        batch_size=3,
        max_task_chars=120,
        examples=AUTO_RL_EXAMPLES,
        allow_fewer=True,
    )
    chosen = list(scenarios)
    random.Random(0).shuffle(chosen)
    held_out, train = chosen[: len(chosen) // 3], chosen[len(chosen) // 3 :]
    system_prompt = autorl.system_prompt_for(AUTO_RL_TASK)
    judge = art.LocalJudge()
    print(f"auto_rl: {len(chosen)} scenarios written by the base model, {len(held_out)} held out", flush=True)

    async def groups(model: art.TrainableModel, step: int) -> list[art.TrajectoryGroup]:
        n = settings.groups_per_step
        return await art.gather_trajectory_groups(
            (
                art.TrajectoryGroup(
                    autorl.rollout(
                        model,
                        train[(step * n + i) % len(train)],
                        system_prompt=system_prompt,
                        max_tokens=max_tokens,
                    )
                    for _ in range(settings.group_size)
                )
                for i in range(n)
            ),
            after_each=lambda g: art.ruler_score_group(g, judge, swallow_exceptions=True),
        )

    async def evaluate(model: art.TrainableModel) -> dict[str, tuple[float, float]]:
        result = await autorl.evaluate(
            model, held_out, judge, system_prompt=system_prompt, max_tokens=max_tokens, samples=4
        )
        means = result.means
        return {"judge score": (means["base"], means["trained"])}

    return Task(
        groups, evaluate, f"evaluation: {len(held_out)} held-out scenarios x 4 answers, judged together"
    )


async def run(args: argparse.Namespace) -> None:
    settings = art.tutorial.Settings(
        quick=False,
        path=args.path,
        steps=args.steps,
        groups_per_step=args.groups,
        group_size=args.group_size,
        eval_scenarios=args.eval_games,
    )
    model = art.TrainableModel(name=f"{args.task}-bench", project="learning", base_model=settings.base_model)
    async with settings.backend(engine=args.engine) as backend:
        t0 = time.monotonic()
        await model.register(backend)
        engine = type(backend.engine_of(model)).__name__
        print(f"registered on {engine} in {time.monotonic() - t0:.0f}s", flush=True)
        task = await make_task(args, settings, model)
        times = []
        for step in range(settings.steps):
            t0 = time.monotonic()
            groups = await task.groups(model, step)
            t1 = time.monotonic()
            await model.train(groups, config=settings.train_config())
            times.append((t1 - t0, time.monotonic() - t1))
            mean = statistics.fmean(t.reward for g in groups for t in g)
            print(
                f"step {step}: reward {mean:.3f}  rollouts {times[-1][0]:.1f}s  train {times[-1][1]:.1f}s",
                flush=True,
            )
        results = await task.evaluate(model)
    print(
        f"\n{args.task}: {settings.steps} steps x {settings.groups_per_step} groups x {settings.group_size} "
        f"games, lr {settings.learning_rate}, engine {engine}; {task.description}"
    )
    print(f"{'metric':<16} {'base (baseline)':>16} {'trained':>10} {'ratio':>7}")
    for m, (base, trained) in results.items():
        print(f"{m:<16} {base:>16.3f} {trained:>10.3f} {trained / base if base else float('nan'):>7.2f}")
    print(
        f"seconds per step: rollouts {statistics.fmean(t[0] for t in times):.1f}, "
        f"training {statistics.fmean(t[1] for t in times):.1f}"
    )


async def make_task(
    args: argparse.Namespace, settings: art.tutorial.Settings, model: art.TrainableModel
) -> Task:
    if args.task == "codenames":
        return codenames_task(settings, args.max_turns or 6)
    if args.task == "auto_rl":
        return await auto_rl_task(settings, model, args.n_scenarios, args.max_tokens or 48)
    if args.task == "2048":  # short games: every move is a training sequence
        rollout = functools.partial(game_2048.rollout, win_tile=args.win_tile, max_moves=args.max_moves)
        return played_task(rollout, ["reward", "win", "max_tile", "valid_move_rate"], settings)
    if args.task == "art_e":  # the rollout's defaults (30 emails, 8 turns of 256 tokens) are a GPU's budget
        quick = email_agent.QUICK
        rollout = functools.partial(
            email_agent.rollout,
            n_emails=args.n_emails,
            max_turns=args.max_turns or quick["max_turns"],
            max_tokens=args.max_tokens or quick["max_tokens"],
        )
        return played_task(rollout, email_agent.METRICS, settings)
    if args.task == "temporal_clue":
        rollout = functools.partial(temporal_clue.rollout, difficulty=1)
        return played_task(rollout, ["reward", "correct_fields", "solved"], settings)
    return played_task(tic_tac_toe.rollout, ["reward", "win", "legal_move_rate"], settings)


TASKS = ("tic_tac_toe", "2048", "temporal_clue", "art_e", "codenames", "auto_rl")

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=TASKS, default="tic_tac_toe")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--groups", type=int, default=2, help="scenarios (boards) per step")
    parser.add_argument("--group-size", type=int, default=8, help="rollouts (codenames: games) per scenario")
    parser.add_argument("--eval-games", type=int, default=32, help="evaluation scenarios per model")
    parser.add_argument("--engine", choices=["auto", "vllm", "hf"], default="auto")
    parser.add_argument("--path", default="/tmp/artnb-learning")
    parser.add_argument("--win-tile", type=int, default=32, help="2048 only")
    parser.add_argument("--max-moves", type=int, default=40, help="2048 only")
    parser.add_argument(
        "--n-emails", type=int, default=email_agent.QUICK["n_emails"], help="art_e only: emails per inbox"
    )
    parser.add_argument(
        "--max-turns",
        type=int,
        help="art_e: replies per rollout (default 2); codenames: team turns (default 6)",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        help="art_e: tokens per reply (default 64); auto_rl: per answer (default 48)",
    )
    parser.add_argument("--n-scenarios", type=int, default=24, help="auto_rl only: scenarios to generate")
    args = parser.parse_args()
    shutil.rmtree(args.path, ignore_errors=True)  # always from the base model
    asyncio.run(run(args))
