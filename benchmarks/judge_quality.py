"""Does an offline judge judge? Score recorded groups with each judge and compare with the task's true reward.

For every group whose true rewards are not all equal, the Spearman rank correlation between the judge's scores
and the true rewards is computed; the table shows its mean over groups per judge and task, the seconds per group,
and the ratio of the mean to the target (Spearman >= 0.5 at <= 60 s per group of 8 on a 2-core CPU).

    python benchmarks/judge_quality.py --record --groups 50      # play and store groups once (minutes per task)
    python benchmarks/judge_quality.py --groups 50                # score them with every judge, print the table
    python benchmarks/judge_quality.py --groups 4 --tasks tic_tac_toe --judges digits   # quick look

Judges (`--judges`): `list` is RULER's list judge, the embedded model served by the HF engine answering one
schema-constrained JSON list per group (`ruler_score_group(g, model.as_base_model())`); `digits` is
`art.LocalJudge()` (the embedded model in-process, expected score from the digit tokens' probabilities,
local_judge.py); `pairwise` is `art.LocalJudge(method="pairwise")`.

Groups: tic-tac-toe starts from the recording that ships with artnb (`artnb.tasks.replay`, 4 groups); every
task reads groups recorded with `--record` from `--data` (default: benchmarks/data, which holds 50 recorded
groups of 8 for tic-tac-toe and Temporal Clue and 96 for ART·E). Temporal Clue is
played at difficulty 1 with temperature 1.0 and constrained answers, so rewards vary within a group. ART·E
(`art_e`) is played with the notebook's quick settings (`email_agent.QUICK`: 12-email inboxes, 2 turns of 64
tokens); the embedded model rarely answers there, so only groups whose progress credits differ are scored, and
the table's `groups` column says how many that was.

    python benchmarks/judge_quality.py --record --tasks art_e --groups 96 --engine vllm   # record ART·E's groups
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # runs from a checkout without `pip install -e .`
import artnb as art  # noqa: E402
from artnb.core.store import RunStore  # noqa: E402
from artnb.tasks import replay  # noqa: E402

TARGET_SPEARMAN = 0.5
TARGET_SECONDS = 60.0
JUDGES = ("list", "digits", "pairwise")
TASKS = ("tic_tac_toe", "temporal_clue", "art_e")  # the keys of rollouts()
DATA = Path(__file__).resolve().parent / "data"


def rollouts() -> dict[str, Callable[..., Any]]:
    """Each task's rollout(model, scenario)."""
    from artnb.tasks import email_agent, temporal_clue, tic_tac_toe

    return {
        "tic_tac_toe": tic_tac_toe.rollout,
        "temporal_clue": functools.partial(temporal_clue.rollout, difficulty=1, temperature=1.0),
        "art_e": functools.partial(email_agent.rollout, **email_agent.QUICK),
    }


def _recording(data: Path, task: str) -> Path:
    return data / f"{task}.parquet"


async def record(tasks: Sequence[str], groups: int, group_size: int, data: Path, engine: str = "hf") -> None:
    """Play `groups` groups per task with the embedded model on `engine`; store them under `data`."""
    found = rollouts()
    with tempfile.TemporaryDirectory() as tmp:
        model = art.TrainableModel(name="recorder", project="judge-quality", base_model=art.models.DEFAULT)
        async with art.LocalBackend(path=tmp, engine=engine) as backend:
            await model.register(backend)
            for task in tasks:
                played = await art.gather_trajectory_groups(
                    (
                        art.TrajectoryGroup(found[task](model, 1000 + s) for _ in range(group_size))
                        for s in range(groups)
                    ),
                    pbar_desc=f"record {task}",
                    max_exceptions=groups * group_size // 10,
                )
                written = RunStore(tmp, "judge-quality", task).write_trajectories("record", 0, played)
                data.mkdir(parents=True, exist_ok=True)
                _recording(data, task).write_bytes(written.read_bytes())
                print(f"{task}: {len(played)} groups -> {_recording(data, task)}", flush=True)


def load(task: str, data: Path) -> list[art.TrajectoryGroup]:
    """The shipped groups (tic-tac-toe only) followed by those recorded under `data`."""
    groups = replay.load(task) if task in replay.RECORDINGS else []
    path = _recording(data, task)
    if path.is_file():
        with tempfile.TemporaryDirectory() as tmp:
            store = RunStore(tmp, "judge-quality", task)
            target = store.trajectories_path("record", 0)
            target.parent.mkdir(parents=True)
            target.write_bytes(path.read_bytes())
            groups += store.read_trajectories("record", 0)
    return groups


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation with average ranks for ties; 0 when either side is constant."""

    def ranks(v: Sequence[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    return sxy / (sxx * syy) ** 0.5 if sxx and syy else 0.0


async def judge_group(judge: str, group: art.TrajectoryGroup, base: art.Model | None) -> list[float]:
    """The judge's score for each trajectory of `group`, in order."""
    if judge == "list":
        if base is None:
            raise ValueError("the list judge needs the embedded model served by an engine")
        scored = await art.ruler_score_group(group, base, cache=False)
    else:
        method = "pairwise" if judge == "pairwise" else "digits"
        scored = await art.ruler_score_group(group, art.LocalJudge(method=method))
    assert scored is not None
    return [t.metrics["ruler_score"] for t in scored.trajectories]


async def measure(
    judges: Sequence[str], groups_by_task: dict[str, list[art.TrajectoryGroup]]
) -> list[dict[str, Any]]:
    """One row per judge and task: groups used, mean Spearman with the true reward, seconds per group."""
    from tqdm.auto import tqdm

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        backend = None
        base = None
        if "list" in judges:
            backend = art.LocalBackend(path=tmp, engine="hf")
            model = art.TrainableModel(name="judge", project="judge-quality", base_model=art.models.DEFAULT)
            await model.register(backend)
            base = model.as_base_model()
        try:
            for judge in judges:
                for task, groups in groups_by_task.items():
                    varied = [g for g in groups if len({t.reward for t in g.trajectories}) > 1]
                    correlations, seconds = [], []
                    for group in tqdm(varied, desc=f"{judge} on {task}"):
                        started = time.monotonic()
                        scores = await judge_group(judge, group, base)
                        seconds.append(time.monotonic() - started)
                        correlations.append(spearman(scores, [t.reward for t in group.trajectories]))
                    rows.append(
                        {
                            "judge": judge,
                            "task": task,
                            "groups": len(varied),
                            "spearman": statistics.fmean(correlations) if correlations else float("nan"),
                            "s_per_group": statistics.fmean(seconds) if seconds else float("nan"),
                        }
                    )
        finally:
            if backend is not None:
                await backend.close()
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        f"{'judge':<10} {'task':<15} {'groups':>6} {'spearman':>9} {'s/group':>8} "
        f"{'spearman/target':>16} {'s/group / target':>17}"
    ]
    for r in rows:
        lines.append(
            f"{r['judge']:<10} {r['task']:<15} {r['groups']:>6} {r['spearman']:>9.3f} {r['s_per_group']:>8.1f} "
            f"{r['spearman'] / TARGET_SPEARMAN:>16.2f} {r['s_per_group'] / TARGET_SECONDS:>17.2f}"
        )
    lines.append(f"target: mean Spearman >= {TARGET_SPEARMAN} at <= {TARGET_SECONDS:g} s per group of 8")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--judges", nargs="+", choices=JUDGES, default=list(JUDGES))
    parser.add_argument(
        "--groups", type=int, default=50, help="groups per task (to record, or at most to score)"
    )
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--data", type=Path, default=DATA, help="recordings folder (default: %(default)s)")
    parser.add_argument("--record", action="store_true", help="play and store groups instead of scoring")
    parser.add_argument(
        "--engine",
        choices=["hf", "vllm"],
        default="hf",
        help="--record's engine; vllm's prefix cache serves ART·E's long shared prompt far faster",
    )
    args = parser.parse_args(argv)
    data, tasks = args.data, args.tasks
    if args.record:
        asyncio.run(record(tasks, args.groups, args.group_size, data, args.engine))
        return []
    groups_by_task = {t: load(t, data)[: args.groups] for t in tasks}
    for task, groups in groups_by_task.items():
        if not groups:
            print(f"{task}: no recorded groups in {data}; record them with --record")
    rows = asyncio.run(measure(args.judges, {t: g for t, g in groups_by_task.items() if g}))
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
