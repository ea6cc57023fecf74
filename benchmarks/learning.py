"""Does training help? Train on a task for N steps with each of `--seeds` seeds, then play the same held-out
scenarios with the base model and the trained one, greedily and sampled, and print each mean with its 95%
interval and the paired difference trained - base with its interval (bootstrap over the scenarios, and over the
seeds when there are several: artnb.core.intervals). Also prints seconds per RL step (rollouts, training),
which is how the engines are compared on a whole loop (`--engine vllm` against `--engine hf`).

Baseline: the base model (the same engine, no adapter) on the same evaluation scenarios. Greedy games show the
model's most likely play, which a few steps often leave unchanged while the distribution sharpens; sampled games
(temperature 1, `--eval-samples` per scenario) show that. A seed sets the training scenarios, the LoRA
initialisation and the run; the held-out scenarios are the same for every seed.

    python benchmarks/learning.py --task tic_tac_toe --steps 8 --seeds 3
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

METRICS = {  # what each task's evaluation reports
    "tic_tac_toe": ["reward", "win", "legal_move_rate"],
    "2048": ["reward", "win", "max_tile", "valid_move_rate"],
    "temporal_clue": ["reward", "correct_fields", "solved"],
    "art_e": email_agent.METRICS,
    "codenames": ["win", "margin", "valid_clue_rate", "own_words_found"],
    "auto_rl": ["judge score"],
}
Groups = Callable[[art.TrainableModel, int], Awaitable[list[art.TrajectoryGroup]]]
# An evaluation: one table in art.evaluate's shape (models labelled base/trained), with a `mode` column.
Evaluation = Callable[[art.TrainableModel], Awaitable[pd.DataFrame]]
SEED_OFFSET = 100_000  # seed k trains on scenarios from k * SEED_OFFSET; held-out ones start at 1,000,000


@dataclass
class Task:
    """How one task trains and is judged: the groups of a step, the held-out evaluation table, its metrics."""

    groups: Groups
    evaluate: Evaluation
    metrics: list[str]
    description: str


def played_task(
    rollout: Callable,
    metrics: list[str],
    settings: art.tutorial.Settings,
    seed: int,
    samples: int,
    concurrency: int | None,
) -> Task:
    """A task whose rollout plays one scenario and scores it itself: the tutorials' games and ART·E."""

    async def groups(model: art.TrainableModel, step: int) -> list[art.TrajectoryGroup]:
        return await art.gather_trajectory_groups(
            art.TrajectoryGroup(rollout(model, s) for _ in range(settings.group_size))
            for s in settings.scenarios(step, offset=seed * SEED_OFFSET)
        )

    async def evaluate(model: art.TrainableModel) -> pd.DataFrame:
        return await art.evaluate_greedy_and_sampled(
            rollout,
            {"base": model.as_base_model(), "trained": model},
            settings.evaluation_scenarios(),
            samples=samples,
            max_concurrent=concurrency,
        )

    description = f"evaluation: {settings.eval_scenarios} held-out games, greedy"
    if samples:
        description += f" and {samples} sampled (temperature 1) each"
    return Task(groups, evaluate, metrics, description)


def codenames_task(settings: art.tutorial.Settings, max_turns: int, seed: int) -> Task:
    metrics = METRICS["codenames"]

    async def groups(model: art.TrainableModel, step: int) -> list[art.TrajectoryGroup]:
        return await codenames.self_play_groups(
            model,
            settings.scenarios(step, offset=seed * SEED_OFFSET),
            games_per_scenario=settings.group_size,
            max_turns=max_turns,
        )

    async def evaluate(model: art.TrainableModel) -> pd.DataFrame:
        table = await codenames.head_to_head(
            {"trained": model, "base": model.as_base_model()},
            settings.evaluation_scenarios(),
            max_turns=max_turns,
        )
        return table.assign(mode="greedy")

    return Task(
        groups,
        evaluate,
        metrics,
        f"{max_turns} team turns a game; evaluation: trained against base on {settings.eval_scenarios} boards, "
        "each played once as each colour",
    )


async def auto_rl_task(
    settings: art.tutorial.Settings, model: art.TrainableModel, n_scenarios: int, max_tokens: int, seed: int
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
    random.Random(seed).shuffle(chosen)
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

    async def evaluate(model: art.TrainableModel) -> pd.DataFrame:
        result = await autorl.evaluate(
            model, held_out, judge, system_prompt=system_prompt, max_tokens=max_tokens, samples=4
        )
        table = result.table.rename(columns={"policy": "model", "score": "judge score"})
        table["scenario"] = table["scenario"].astype(str)
        return table.assign(mode="sampled")

    return Task(
        groups,
        evaluate,
        METRICS["auto_rl"],
        f"evaluation: {len(held_out)} held-out scenarios x 4 answers (temperature 1), judged together",
    )


async def run_seed(args: argparse.Namespace, seed: int) -> tuple[Task, pd.DataFrame, list, str]:
    """Train one seed from the base model; its evaluation table (`run` = seed) and seconds per step."""
    path = f"{args.path}/seed-{seed}"
    shutil.rmtree(path, ignore_errors=True)  # always from the base model
    settings = art.tutorial.Settings(
        quick=False,
        path=path,
        steps=args.steps,
        groups_per_step=args.groups,
        group_size=args.group_size,
        eval_scenarios=args.eval_games,
        learning_rate=args.lr,
    )
    model = art.TrainableModel(name=f"{args.task}-bench", project="learning", base_model=settings.base_model)
    trainer = art.TrainerConfig(seed=seed)
    async with settings.backend(engine=args.engine, trainer_config=trainer) as backend:
        t0 = time.monotonic()
        await model.register(backend)
        engine = type(backend.engine_of(model)).__name__
        print(f"seed {seed}: registered on {engine} in {time.monotonic() - t0:.0f}s", flush=True)
        task = await make_task(args, settings, model, seed)
        times = []
        for step in range(settings.steps):
            t0 = time.monotonic()
            groups = await task.groups(model, step)
            t1 = time.monotonic()
            await model.train(groups, config=settings.train_config())
            times.append((t1 - t0, time.monotonic() - t1))
            mean = statistics.fmean(t.reward for g in groups for t in g)
            print(
                f"seed {seed} step {step}: reward {mean:.3f}  rollouts {times[-1][0]:.1f}s  "
                f"train {times[-1][1]:.1f}s",
                flush=True,
            )
        table = await task.evaluate(model)
    return task, table.assign(run=seed), times, engine


async def run(args: argparse.Namespace) -> None:
    tables, times = [], []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        task, table, seed_times, engine = await run_seed(args, seed)
        tables.append(table)
        times += seed_times
        print(f"\nseed {seed}:")
        report(table, task.metrics)
        table = pd.concat(tables, ignore_index=True)
        if args.out:  # after every seed, so a long run interrupted keeps what it measured
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            table.to_csv(args.out, index=False)
    lr = args.lr or art.tutorial.SMALL_MODEL_LR
    print(
        f"\n{args.task}: {args.steps} steps x {args.groups} groups x {args.group_size} games, lr {lr}, "
        f"engine {engine}, {args.seeds} seed(s) from {args.first_seed}; {task.description}"
    )
    print(
        "95% intervals: bootstrap over held-out scenarios"
        + (" and over seeds (each seed a training run)" if args.seeds > 1 else "")
    )
    report(table, task.metrics)
    print(
        f"seconds per step: rollouts {statistics.fmean(t[0] for t in times):.1f}, "
        f"training {statistics.fmean(t[1] for t in times):.1f}"
    )


def report(table: pd.DataFrame, metrics: list[str]) -> None:
    """Base and trained with intervals, and the paired difference, for each evaluation mode."""
    for mode, rows in table.groupby("mode", sort=False):
        present = [m for m in metrics if m in rows.columns and rows[m].notna().any()]
        print(f"{mode}:")
        print(art.format_comparison(art.compare_evaluation(rows, present, model="trained")))


async def make_task(
    args: argparse.Namespace, settings: art.tutorial.Settings, model: art.TrainableModel, seed: int
) -> Task:
    samples = args.eval_samples
    if args.task == "codenames":
        return codenames_task(settings, args.max_turns or 6, seed)
    if args.task == "auto_rl":
        return await auto_rl_task(settings, model, args.n_scenarios, args.max_tokens or 48, seed)
    if args.task == "2048":  # short games: every move is a training sequence
        rollout = functools.partial(game_2048.rollout, win_tile=args.win_tile, max_moves=args.max_moves)
        return played_task(
            rollout,
            METRICS["2048"],
            settings,
            seed,
            samples,
            args.eval_concurrency,
        )
    if args.task == "art_e":  # the rollout's defaults (30 emails, 8 turns of 256 tokens) are a GPU's budget
        quick = email_agent.QUICK
        rollout = functools.partial(
            email_agent.rollout,
            n_emails=args.n_emails,
            max_turns=args.max_turns or quick["max_turns"],
            max_tokens=args.max_tokens or quick["max_tokens"],
        )
        return played_task(rollout, METRICS["art_e"], settings, seed, samples, args.eval_concurrency)
    if args.task == "temporal_clue":
        rollout = functools.partial(temporal_clue.rollout, difficulty=1)
        return played_task(rollout, METRICS["temporal_clue"], settings, seed, samples, args.eval_concurrency)
    return played_task(
        tic_tac_toe.rollout,
        METRICS["tic_tac_toe"],
        settings,
        seed,
        samples,
        args.eval_concurrency,
    )


TASKS = ("tic_tac_toe", "2048", "temporal_clue", "art_e", "codenames", "auto_rl")

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=TASKS, default="tic_tac_toe")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--groups", type=int, default=2, help="scenarios (boards) per step")
    parser.add_argument("--group-size", type=int, default=8, help="rollouts (codenames: games) per scenario")
    parser.add_argument("--eval-games", type=int, default=32, help="held-out scenarios per model")
    parser.add_argument(
        "--eval-samples", type=int, default=4, help="sampled games per held-out scenario (0: greedy only)"
    )
    parser.add_argument(
        "--eval-concurrency",
        type=int,
        default=32,
        help="evaluation games in flight (vLLM's CPU KV cache holds ~32 game histories for prefix reuse)",
    )
    parser.add_argument("--seeds", type=int, default=1, help="training runs, one per seed")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--lr", type=float, help="learning rate (default: 1e-3 for the embedded model)")
    parser.add_argument("--out", help="write the evaluation table (every game of every seed) to this CSV")
    parser.add_argument(
        "--report",
        metavar="CSV",
        nargs="+",
        help="train nothing: print the intervals of tables written by --out",
    )
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
    if args.report:
        report(pd.concat([pd.read_csv(path) for path in args.report], ignore_index=True), METRICS[args.task])
    else:
        asyncio.run(run(args))
