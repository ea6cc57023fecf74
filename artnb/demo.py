"""`make demo` / `artnb demo`: train the embedded model on tic-tac-toe on this machine and report the curve.

One readable recipe: register; a preflight of the first step's games (can this reward teach? its verdict is
printed first, and its games become step 0's batch); per step gather groups of games, train, print a line; then
the base model and the trained one play the same held-out games, greedily and sampled, and the demo prints each
mean with its 95% interval and the paired difference trained - base with its interval, and writes an HTML
report with the reward curves and that comparison. Each group replays one opponent seed, so the rollouts in a
group differ only by the model's sampling, which is what GRPO compares.

Why sampled games too: a few steps of RL on a small model mostly sharpen a preference it already had, so its
greedy games often stay the same move for move (measured: after 15 steps the first move's distribution had
moved by a total variation of 0.34, and the greedy move was unchanged on 60 of 60 boards). Sampled games see
the whole distribution; the greedy ones show what the model does most often. The demo says which is which.

With `--ruler`, each group is scored by RULER before training and the model trains on the judge's scores. The
judge is `art.LocalJudge()` (the embedded 135M model grading each game from its digit probabilities, in this
process: offline, no API key, a few seconds a group), or the litellm model given with `--judge` (e.g.
`--judge openai/gpt-4o-mini`, with its API key set). Which judge scored is printed first; the first group's
game rewards are printed beside the judge's scores, and the step lines, the report's curves and the base vs
trained games keep the game's own reward. The offline judge agrees only weakly with the game (mean Spearman
0.25 on recorded tic-tac-toe groups, benchmarks/judge_quality.py): it shows the pipeline running, not good
judgement; use a hosted judge to train on RULER for real.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from functools import partial
from html import escape as html_escape
from pathlib import Path

from . import models
from .backends.engine_launch import EngineKind
from .backends.local import LocalBackend
from .core.compare import compare_rewards
from .core.config import TrainConfig
from .core.evaluate import (
    compare_evaluation,
    evaluate_greedy_and_sampled,
    format_comparison,
    paired_difference,
)
from .core.gather import gather_trajectory_groups
from .core.model import TrainableModel, summarize_groups
from .core.preflight import PreflightReport, preflight
from .core.ruler import ruler_score_group
from .core.trajectory import TrajectoryGroup
from .local_judge import LocalJudge
from .plots import evaluation_figure, reward_figure
from .tasks import tic_tac_toe


@dataclass
class DemoConfig:
    # RL steps, ~25 s each on 2 CPU cores. Measured over seeds 0-2 (sampled reward, trained - base, README "make
    # demo"): 10 steps of 3 groups at 1e-3 showed learning on all three; 8 steps of 2 groups on two of them, and
    # 2e-3 made one collapse.
    steps: int = 10
    groups_per_step: int = 3  # opponent seeds per step
    group_size: int = 8  # games per seed; GRPO compares these
    learning_rate: float = 1e-3  # the 135M model needs ~1e-3; 3B+ models want ~1e-5
    base_model: str = models.DEFAULT
    path: str = "./.art"
    name: str = "tic-tac-toe-demo"
    project: str = "artnb-demo"
    report: str = "reports/demo.html"
    seed: int = 0
    engine: EngineKind = "auto"
    ruler: bool = False  # train on RULER's scores of each group instead of the game's reward
    judge: str = ""  # with ruler: a litellm model ("openai/gpt-4o-mini", needs its key); "": art.LocalJudge()
    eval_games: int = 16  # held-out opponent seeds both models play at the end (0: skip)
    eval_samples: int = 4  # sampled games (temperature 1) per held-out seed, beside one greedy game
    preflight: bool = True  # check the first step's games before training on them


def demo_judge(cfg: DemoConfig) -> str | LocalJudge | None:
    """RULER's judge for `cfg`: None without --ruler, the --judge litellm model, else the offline LocalJudge."""
    if not cfg.ruler:
        return None
    return cfg.judge or LocalJudge()


def describe_judge(judge: str | LocalJudge) -> str:
    if isinstance(judge, LocalJudge):
        return (
            f"{_short(judge)}: {judge.base_model} in this process grades each game from its digit probabilities. "
            "A weak judge: mean Spearman 0.25 with the game's reward on recorded groups (benchmarks/judge_quality.py)"
        )
    return f"{judge} (hosted, through litellm)"


async def run_demo(cfg: DemoConfig) -> list[dict]:
    if cfg.judge and not cfg.ruler:
        raise ValueError(f"--judge {cfg.judge} is RULER's judge: add --ruler to train on its scores")
    model = TrainableModel(name=cfg.name, project=cfg.project, base_model=cfg.base_model)
    judge = demo_judge(cfg)
    rows = []
    async with LocalBackend(path=cfg.path, engine=cfg.engine) as backend:
        t0 = time.monotonic()
        await model.register(backend)
        print(
            f"registered {cfg.base_model} in {time.monotonic() - t0:.0f}s; resuming at step {await model.get_step()}"
        )
        if judge is not None:
            print(f"training reward: RULER, judged by {describe_judge(judge)}")
            print(
                "step lines: `reward` is the game's, `ruler` the judge's mean score (what the model trains on)"
            )
        start = await model.get_step()
        checked = await _preflight(model, cfg, judge, start) if cfg.preflight and cfg.steps else None
        ruler_col = f" {'ruler':>6}" if judge is not None else ""
        print(f"{'step':>4} {'reward':>7} {'legal':>6} {'win':>5}{ruler_col} {'rollout_s':>9} {'train_s':>7}")
        for step in range(start, start + cfg.steps):
            if step == start and checked is not None:  # the preflight played (and judged) these games
                groups, rollout_s = checked.groups, (checked.batch.rollout_s or 0.0) + checked.batch.judge_s
            else:
                t0 = time.monotonic()
                groups = await gather_trajectory_groups(
                    (
                        TrajectoryGroup(tic_tac_toe.rollout(model, s) for _ in range(cfg.group_size))
                        for s in _seeds(cfg, step)
                    ),
                    pbar_desc=f"gather step {step}",
                    after_each=partial(ruler_score_group, judge_model=judge) if judge is not None else None,
                )
                rollout_s = time.monotonic() - t0
            if judge is not None and step == start and groups:
                table = compare_rewards(groups[0]).trajectories
                print(f"first group: game reward beside the score of {_short(judge)} (rank 1 = best)")
                print(
                    table[["independent_reward", "ruler_score", "independent_rank", "ruler_rank"]].to_string()
                )
            t0 = time.monotonic()
            await model.train(groups, config=TrainConfig(learning_rate=cfg.learning_rate))
            train_s = time.monotonic() - t0
            s = summarize_groups(groups)
            row = {"step": step, **s, "rollout_s": rollout_s, "train_s": train_s}
            rows.append(row)
            game = s.get("independent_reward", s["reward"])  # with RULER, the game's reward is kept here
            ruler = f" {s['ruler_score']:>6.3f}" if judge is not None else ""
            print(
                f"{step:>4} {game:>7.3f} {s['legal_move_rate']:>6.2f} {s['win']:>5.2f}{ruler} "
                f"{rollout_s:>9.1f} {train_s:>7.1f}",
                flush=True,
            )
        history = model.history()
        evaluation = await _base_against_trained(model, cfg) if cfg.eval_games else None
    report = Path(cfg.report)
    report.parent.mkdir(parents=True, exist_ok=True)
    curves = [("legal_move_rate", "legal-move rate"), ("win", "win rate")]
    if judge is None:
        curves.insert(0, ("reward", "mean reward"))
        trained_on = "<p>Training reward: the game's own.</p>"
    else:
        curves[:0] = [
            ("independent_reward", "mean game reward"),
            ("ruler_score", f"mean RULER score ({_short(judge)})"),
        ]
        trained_on = (
            f"<p>Training reward: RULER's scores, judged by {html_escape(describe_judge(judge))}. "
            "The game reward, legal-move and win curves and the evaluation below are the game's own; the "
            "RULER curve is the judge's mean score.</p>"
        )
    figs = [reward_figure(history, m, title=t) for m, t in curves]
    if evaluation is not None:
        for mode, games in evaluation.groupby("mode", sort=False):
            fig = evaluation_figure(games, EVAL_METRICS)
            # plotly's properties are untyped: pyright reads `fig.layout` as a Figure
            title = fig.layout.title.text  # pyright: ignore[reportAttributeAccessIssue]
            fig.update_layout(title=f"{title}: {mode} games")
            figs.append(fig)
    html = (
        "<h1>artnb demo: tic-tac-toe</h1>"
        + trained_on
        + "".join(f.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, f in enumerate(figs))
    )
    report.write_text(f"<html><head><meta charset='utf-8'></head><body>{html}</body></html>")
    print(f"report: {report.resolve()}")
    return rows


def _short(judge: str | LocalJudge) -> str:
    return f"{judge.label}, offline" if isinstance(judge, LocalJudge) else judge


EVAL_METRICS = ("reward", "win", "legal_move_rate")
EVAL_SEEDS_FROM = 1_000_000  # never a training seed
# Games in flight during the evaluation: vLLM's CPU KV cache (512 MiB, ~11k tokens of this model) keeps about
# this many game histories for the prefix cache; hundreds at once push each other out and every move re-reads
# its whole game.
EVAL_CONCURRENCY = 32


def _seeds(cfg: DemoConfig, step: int) -> list[int]:
    """The opponent seeds of a step's groups: new every step, different per `--seed`."""
    return [cfg.seed * 100_000 + step * cfg.groups_per_step + i for i in range(cfg.groups_per_step)]


async def _preflight(model: TrainableModel, cfg: DemoConfig, judge, step: int) -> PreflightReport:
    """Check the first step's games before training on them; print the verdict and every check."""
    report = await preflight(
        model, tic_tac_toe.rollout, _seeds(cfg, step), group_size=cfg.group_size, judge=judge
    )
    print(report)
    return report


async def _base_against_trained(model: TrainableModel, cfg: DemoConfig):
    """The same held-out games for the base model and the newest checkpoint, greedy and sampled; each mean
    with its interval and the paired difference, printed."""
    trained = f"trained (step {await model.get_step()})"
    models_ = {"base": model.as_base_model(), trained: model}
    seeds = range(EVAL_SEEDS_FROM, EVAL_SEEDS_FROM + cfg.eval_games)
    table = await evaluate_greedy_and_sampled(
        tic_tac_toe.rollout, models_, seeds, samples=cfg.eval_samples, max_concurrent=EVAL_CONCURRENCY
    )
    print(f"\nbase vs trained on the same {cfg.eval_games} held-out games (95% intervals over the games)")
    for mode, games in table.groupby("mode", sort=False):
        how = "greedy (temperature 0)" if mode == "greedy" else f"sampled, {cfg.eval_samples} per game"
        print(f"{how}:")
        print(format_comparison(compare_evaluation(games, EVAL_METRICS, model=trained)))
    kind = table["mode"].iloc[-1]  # the sampled games when there are any: they show what training changed
    diff = paired_difference(table[table["mode"] == kind], "reward", model=trained)
    if diff.low > 0:
        verdict = "training helped: the interval is above 0"
    elif diff.high < 0:
        verdict = "training hurt: the interval is below 0"
    else:
        verdict = (
            "these games cannot tell the two apart: the interval holds 0 (train longer, or play more games)"
        )
    print(f"trained - base, reward on {kind} games: {diff}  {verdict}")
    return table


def main(cfg: DemoConfig) -> list[dict]:
    return asyncio.run(run_demo(cfg))
