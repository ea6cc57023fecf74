"""Does training help? Train on a task for N steps, then play the same evaluation games with the base model and
the trained model, and print both with their ratio. Also prints seconds per RL step (rollouts, training),
which is how the engines are compared on a whole loop (`--engine vllm` against `--engine hf`).

Baseline: the base model (the same engine, no adapter) on the same evaluation scenarios, played greedily.

    python benchmarks/learning.py --task tic_tac_toe --steps 12
    python benchmarks/learning.py --task 2048 --steps 8 --engine hf
    python benchmarks/learning.py --task temporal_clue --steps 12
    python benchmarks/learning.py --task art_e --steps 8     # the notebook's quick inboxes: 12 emails, 2 turns

Every tutorial's task is here but Codenames (self-play: each game makes groups for four roles, see
notebooks/codenames.ipynb) and AutoRL (its reward is a judge's, so `artnb.autorl.evaluate` compares base and
trained there).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # runs from a checkout without `pip install -e .`
import artnb as art  # noqa: E402
from artnb.tasks import email_agent, game_2048, temporal_clue, tic_tac_toe  # noqa: E402

TASKS = {
    "tic_tac_toe": (tic_tac_toe.rollout, ["reward", "win", "legal_move_rate"]),
    "2048": (game_2048.rollout, ["reward", "win", "max_tile", "valid_move_rate"]),
    "temporal_clue": (
        functools.partial(temporal_clue.rollout, difficulty=1),
        ["reward", "correct_fields", "solved"],
    ),
    "art_e": (email_agent.rollout, email_agent.METRICS),
}


async def run(args: argparse.Namespace) -> None:
    rollout, metrics = TASKS[args.task]
    if args.task == "2048":  # short games: every move is a training sequence
        rollout = functools.partial(rollout, win_tile=args.win_tile, max_moves=args.max_moves)
    if args.task == "art_e":  # the rollout's defaults (30 emails, 8 turns of 256 tokens) are a GPU's budget
        rollout = functools.partial(
            rollout, n_emails=args.n_emails, max_turns=args.max_turns, max_tokens=args.max_tokens
        )
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
        times = []
        for step in range(settings.steps):
            t0 = time.monotonic()
            groups = await art.gather_trajectory_groups(
                art.TrajectoryGroup(rollout(model, s) for _ in range(settings.group_size))
                for s in settings.scenarios(step)
            )
            t1 = time.monotonic()
            await model.train(groups, config=settings.train_config())
            times.append((t1 - t0, time.monotonic() - t1))
            mean = statistics.fmean(t.reward for g in groups for t in g)
            print(
                f"step {step}: reward {mean:.3f}  rollouts {times[-1][0]:.1f}s  train {times[-1][1]:.1f}s",
                flush=True,
            )
        table = await art.evaluate(
            rollout,
            {"base": model.as_base_model(), "trained": model},
            settings.evaluation_scenarios(),
            temperature=0,
        )
    summary = art.summarize_evaluation(table, metrics)
    print(
        f"\n{args.task}: {settings.steps} steps x {settings.groups_per_step} groups x {settings.group_size} "
        f"games, lr {settings.learning_rate}, engine {engine}; evaluation: {settings.eval_scenarios} games each"
    )
    print(f"{'metric':<16} {'base (baseline)':>16} {'trained':>10} {'ratio':>7}")
    for m in metrics:
        base, trained = summary.loc["base", (m, "mean")], summary.loc["trained", (m, "mean")]
        print(f"{m:<16} {base:>16.3f} {trained:>10.3f} {trained / base if base else float('nan'):>7.2f}")
    print(
        f"seconds per step: rollouts {statistics.fmean(t[0] for t in times):.1f}, "
        f"training {statistics.fmean(t[1] for t in times):.1f}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="tic_tac_toe")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--groups", type=int, default=2, help="scenarios per step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--eval-games", type=int, default=32)
    parser.add_argument("--engine", choices=["auto", "vllm", "hf"], default="auto")
    parser.add_argument("--path", default="/tmp/artnb-learning")
    parser.add_argument("--win-tile", type=int, default=32, help="2048 only")
    parser.add_argument("--max-moves", type=int, default=40, help="2048 only")
    quick = email_agent.QUICK
    parser.add_argument(
        "--n-emails", type=int, default=quick["n_emails"], help="art_e only: emails per inbox"
    )
    parser.add_argument(
        "--max-turns", type=int, default=quick["max_turns"], help="art_e only: replies per rollout"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=quick["max_tokens"], help="art_e only: tokens per reply"
    )
    args = parser.parse_args()
    shutil.rmtree(args.path, ignore_errors=True)  # always from the base model
    asyncio.run(run(args))
