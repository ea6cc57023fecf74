"""`make demo` / `artnb demo`: train the embedded model on tic-tac-toe on this machine and report the curve.

One readable recipe: register, then per step gather groups of games, train, print a line; then play the same
fixed evaluation games greedily with the base model and the trained one, so a newcomer sees what training did,
and write an HTML report with the reward curves and that comparison. Each group replays one opponent seed, so the rollouts in a group differ only
by the model's sampling, which is what GRPO compares.

With `--ruler`, each group is scored by RULER before training, the judge being the base model on the same
engine: offline, no API key. The first group's game rewards are printed beside the judge's scores. A 135M
judge shows that the pipeline runs, not good judgement: use a stronger judge for real work.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from . import models
from .backends.local import LocalBackend
from .core.compare import compare_rewards
from .core.config import TrainConfig
from .core.evaluate import evaluate, summarize_evaluation
from .core.gather import gather_trajectory_groups
from .core.model import TrainableModel, summarize_groups
from .core.ruler import ruler_score_group
from .core.trajectory import TrajectoryGroup
from .plots import evaluation_figure, reward_figure
from .tasks import tic_tac_toe


@dataclass
class DemoConfig:
    steps: int = 5  # RL steps; 40-100 s each for the embedded model on 2 CPU cores
    groups_per_step: int = 2  # opponent seeds per step
    group_size: int = 8  # games per seed; GRPO compares these
    learning_rate: float = 1e-3  # the 135M model needs ~1e-3; 3B+ models want ~1e-5
    base_model: str = models.DEFAULT
    path: str = "./.art"
    name: str = "tic-tac-toe-demo"
    project: str = "artnb-demo"
    report: str = "reports/demo.html"
    seed: int = 0
    engine: str = "auto"
    ruler: bool = False  # rewards from RULER (the base model judging each group) instead of the game's
    eval_games: int = 16  # fixed opponent seeds both models play greedily at the end (0: skip)


async def run_demo(cfg: DemoConfig) -> list[dict]:
    model = TrainableModel(name=cfg.name, project=cfg.project, base_model=cfg.base_model)
    rows = []
    async with LocalBackend(path=cfg.path, engine=cfg.engine) as backend:
        t0 = time.monotonic()
        await model.register(backend)
        print(
            f"registered {cfg.base_model} in {time.monotonic() - t0:.0f}s; resuming at step {await model.get_step()}"
        )
        print(f"{'step':>4} {'reward':>7} {'legal':>6} {'win':>5} {'rollout_s':>9} {'train_s':>7}")
        start = await model.get_step()
        for step in range(start, start + cfg.steps):
            t0 = time.monotonic()
            seeds = [cfg.seed * 100_000 + step * cfg.groups_per_step + i for i in range(cfg.groups_per_step)]
            judge = model.as_base_model() if cfg.ruler else None  # the untrained base model, same engine
            groups = await gather_trajectory_groups(
                (
                    TrajectoryGroup(tic_tac_toe.rollout(model, s) for _ in range(cfg.group_size))
                    for s in seeds
                ),
                pbar_desc=f"gather step {step}",
                after_each=partial(ruler_score_group, judge_model=judge) if judge else None,
            )
            if judge and step == start:
                table = compare_rewards(groups[0]).trajectories
                print("first group: game reward beside RULER score (rank 1 = best)")
                print(
                    table[["independent_reward", "ruler_score", "independent_rank", "ruler_rank"]].to_string()
                )
            rollout_s = time.monotonic() - t0
            t0 = time.monotonic()
            await model.train(groups, config=TrainConfig(learning_rate=cfg.learning_rate))
            train_s = time.monotonic() - t0
            s = summarize_groups(groups)
            row = {"step": step, **s, "rollout_s": rollout_s, "train_s": train_s}
            rows.append(row)
            print(
                f"{step:>4} {s['reward']:>7.3f} {s['legal_move_rate']:>6.2f} {s['win']:>5.2f} "
                f"{rollout_s:>9.1f} {train_s:>7.1f}",
                flush=True,
            )
        history = model.history()
        evaluation = await _base_against_trained(model, cfg) if cfg.eval_games else None
    report = Path(cfg.report)
    report.parent.mkdir(parents=True, exist_ok=True)
    figs = [
        reward_figure(history, m, title=t)
        for m, t in [("reward", "mean reward"), ("legal_move_rate", "legal-move rate"), ("win", "win rate")]
    ]
    if evaluation is not None:
        figs.append(evaluation_figure(evaluation, EVAL_METRICS))
    html = "<h1>artnb demo: tic-tac-toe</h1>" + "".join(
        f.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, f in enumerate(figs)
    )
    report.write_text(f"<html><head><meta charset='utf-8'></head><body>{html}</body></html>")
    print(f"report: {report.resolve()}")
    return rows


EVAL_METRICS = ("reward", "win", "legal_move_rate")
EVAL_SEEDS_FROM = 1_000_000  # never a training seed


async def _base_against_trained(model: TrainableModel, cfg: DemoConfig):
    """The same fixed games, greedy, for the base model and the newest checkpoint; printed as a table."""
    models_ = {"base": model.as_base_model(), f"trained (step {await model.get_step()})": model}
    seeds = range(EVAL_SEEDS_FROM, EVAL_SEEDS_FROM + cfg.eval_games)
    table = await evaluate(tic_tac_toe.rollout, models_, seeds, temperature=0, pbar_desc="base vs trained")
    summary = summarize_evaluation(table, EVAL_METRICS)
    print(f"\nbase vs trained: the same {cfg.eval_games} games, greedy (temperature 0)")
    print(f"{'model':<20} {'reward':>7} {'win':>5} {'legal':>6}")
    for label in summary.index:
        means = [summary.loc[label, (m, "mean")] for m in EVAL_METRICS]
        print(f"{label:<20} {means[0]:>7.3f} {means[1]:>5.2f} {means[2]:>6.2f}")
    return table


def main(cfg: DemoConfig) -> list[dict]:
    return asyncio.run(run_demo(cfg))
