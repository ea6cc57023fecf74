"""Soak: train the tiny model for many steps while killing the training process and its engine at random moments.

A worker process (this script with `--worker`) registers a run on the HF engine and trains step after step,
printing after each commit its step, resident memory, open file descriptors and the engine's pid. This process
(the soak) starts it, and before each step decides at random whether to SIGKILL the worker or its engine, at a
random moment of that step (gather, train, commit: wherever the clock falls). A dead worker is started again
(it resumes at the run's newest step); a dead engine is restarted by the worker's next request. At the end the
run must agree with itself step for step: checkpoints 0..N, one train history row and one batch of rollouts per
step, every commit in the history, no leftover temp directory. The table reports, per window of steps, the
kills survived, the worker's resident memory and open files (their growth within one worker's life, which is
what a leak would show), and the inconsistencies found.

Baseline: the run's own first window (memory and descriptors should not grow past it by more than the stated
bounds: 64 MiB of resident memory and 8 descriptors over the whole run).

    python benchmarks/soak.py                      # 200 steps, a kill every ~5 steps on average
    python benchmarks/soak.py --steps 20 --kill-rate 0.5 --window 5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # runs from a checkout without `pip install -e .`
import artnb as art  # noqa: E402
from artnb.core.store import PENDING_ROLLOUTS, RunStore  # noqa: E402

GROUPS, GROUP_SIZE = 2, 4
RSS_BOUND = 64 * 2**20  # growth of one worker's resident memory over the run
FD_BOUND = 8  # growth of one worker's open file descriptors over the run


# The worker ------------------------------------------------------------------------------------------------


async def pick(model: art.TrainableModel, seed: int, index: int) -> art.Trajectory:
    """Answer A or B; the reward varies with the index, so every group has something to learn."""
    messages = [{"role": "system", "content": "Answer A or B."}, {"role": "user", "content": "Which?"}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(),
        messages=messages,
        max_tokens=2,
        seed=seed,
        extra_body={"structured_outputs": {"choice": ["A", "B"]}},
    )
    return art.Trajectory(messages_and_choices=[*messages, completion.choices[0]], reward=index / GROUP_SIZE)


def usage() -> tuple[int, int]:
    """This process's resident memory in bytes and its open file descriptors."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return rss, len(os.listdir("/proc/self/fd"))


async def worker(run_dir: str, base: str) -> None:
    model = art.TrainableModel(name="soak", project="soak", base_model=base)
    async with art.LocalBackend(path=run_dir, engine="hf") as backend:
        await model.register(backend)
        while True:
            step = await model.get_step()
            print(f"ENGINE {backend.engine_of(model).pid}", flush=True)
            groups = await art.gather_trajectory_groups(
                (
                    art.TrajectoryGroup(pick(model, step * 100 + g * 10 + i, i) for i in range(GROUP_SIZE))
                    for g in range(GROUPS)
                ),
                max_exceptions=GROUPS
                * GROUP_SIZE,  # rollouts cut off by an engine kill: dropped, retried next
            )
            if any(len(g) < 2 for g in groups):
                continue  # the engine died mid-gather: gather again (the next request restarts it)
            result = await model.train(groups, config=art.TrainConfig(learning_rate=1e-2))
            rss, fds = usage()
            print(f"STEP {result.step} {rss} {fds}", flush=True)


# The soak --------------------------------------------------------------------------------------------------


@dataclass
class Window:
    steps: list[int] = field(default_factory=list)
    trainer_kills: int = 0
    engine_kills: int = 0
    rss: list[int] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)


class Worker:
    """The worker process and the lines it prints, read on a thread so the soak can wait with a timeout."""

    def __init__(self, run_dir: Path, base: str, log) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", str(run_dir), base],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            start_new_session=True,  # its own process group: a kill of the worker takes nobody else
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.engine_pid: int | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)

    def next_line(self, timeout: float) -> str | None:
        """The next line, "" on timeout, None once the worker is gone."""
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            return ""
        if line and line.startswith("ENGINE "):
            self.engine_pid = int(line.split()[1])
        return line

    def kill(self) -> None:
        """SIGKILL the worker alone, as a crashed kernel would die; its engine notices and exits on its own."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def soak(args: argparse.Namespace) -> int:
    run_dir = Path(args.path)
    shutil.rmtree(run_dir, ignore_errors=True)
    base = art.models.tiny()
    rng = random.Random(args.seed)
    windows: dict[int, Window] = {}
    life_start: tuple[int, int] | None = None  # (rss, fds) at the first step of the current worker
    growth_rss = growth_fd = 0
    step_s = 0.5  # the last undisturbed step's duration, to place the next kill within a step
    disturbed = True  # the coming step's time includes a start or restart (the first: registration)
    step = 0
    log = open(run_dir.parent / f"{run_dir.name}-worker.log", "w")  # noqa: SIM115 (open for the whole soak)
    worker = Worker(run_dir, base, log)
    last = started = time.monotonic()

    def plan() -> tuple[float, str] | None:
        """Whether the coming step gets a kill, of which process, and when (within about a step's time)."""
        if rng.random() >= args.kill_rate:
            return None
        return time.monotonic() + rng.uniform(0.0, step_s), rng.choice(["trainer", "engine"])

    planned = None  # the first worker registers and trains its first step undisturbed
    while step < args.steps:
        timeout = max(0.05, planned[0] - time.monotonic()) if planned else 600.0
        line = worker.next_line(timeout)
        window = windows.setdefault(step // args.window, Window())
        if line is None or (planned and time.monotonic() >= planned[0]):
            what = planned[1] if planned and line is not None else "trainer"
            print(
                f"step {step + 1}: {'the worker exited' if line is None else f'kill -9 the {what}'}",
                flush=True,
            )
            if line is None or what == "trainer":
                worker.kill()
                window.trainer_kills += line is not None
                worker = Worker(run_dir, base, log)
                life_start = None
            elif worker.engine_pid is not None:
                try:
                    os.killpg(worker.engine_pid, signal.SIGKILL)
                    window.engine_kills += 1
                except ProcessLookupError:
                    pass
            planned, disturbed = None, True
            continue
        if line.startswith("STEP "):
            _, n, rss, fds = line.split()
            step, rss, fds = int(n), int(rss), int(fds)
            now = time.monotonic()
            if not disturbed:
                step_s = now - last
            last, disturbed = now, False
            planned = planned or plan()  # a kill not yet done still happens, in the next step
            window.steps.append(step)
            window.rss.append(rss)
            window.fds.append(fds)
            if life_start is None:
                life_start = (rss, fds)
            growth_rss = max(growth_rss, rss - life_start[0])
            growth_fd = max(growth_fd, fds - life_start[1])
    worker.kill()
    log.close()
    problems = check(RunStore(run_dir, "soak", "soak"), step)
    print(
        f"\nsoak: {step} steps of the tiny model (HF engine, {GROUPS} x {GROUP_SIZE} rollouts a step), kill rate "
        f"{args.kill_rate} a step, seed {args.seed}, {time.monotonic() - started:.0f} s"
    )
    print("| steps | trainer kills | engine kills | worker RSS MiB (max) | open fds (max) |")
    print("|---|---|---|---|---|")
    for k in sorted(windows):
        w = windows[k]
        if not w.steps:
            continue
        print(
            f"| {min(w.steps)}-{max(w.steps)} | {w.trainer_kills} | {w.engine_kills} | "
            f"{max(w.rss) / 2**20:.0f} | {max(w.fds)} |"
        )
    kills = sum(w.trainer_kills for w in windows.values()), sum(w.engine_kills for w in windows.values())
    print(
        f"kills survived: {kills[0]} of the worker, {kills[1]} of the engine; growth within one worker: RSS "
        f"{growth_rss / 2**20:.1f} MiB (bound {RSS_BOUND / 2**20:.0f}), fds {growth_fd} (bound {FD_BOUND}); "
        f"inconsistencies: {len(problems)}"
    )
    for problem in problems:
        print(f"  {problem}")
    bounded = growth_rss <= RSS_BOUND and growth_fd <= FD_BOUND
    return 0 if not problems and bounded else 1


def check(store: RunStore, steps: int) -> list[str]:
    """What disagrees in the run: checkpoints, history rows, rollouts and commits, step by step."""
    problems = []
    if store.steps() != list(range(steps + 1)):
        problems.append(f"checkpoints {store.steps()}, expected 0..{steps}")
    history = store.history()
    trained = sorted(history[history["split"] == "train"]["step"]) if len(history) else []
    if trained != list(range(steps)):
        problems.append(f"train history rows for steps {trained}, expected one for each of 0..{steps - 1}")
    commits = set(history["commit"]) if "commit" in history else set()
    for s in range(steps):
        groups = store.read_trajectories("train", s) if store.trajectories_path("train", s).exists() else []
        if sum(len(g) for g in groups) < GROUPS * 2:
            problems.append(f"step {s}: {sum(len(g) for g in groups)} rollouts recorded")
        commit = store.read_commit(s + 1)
        if commit is None or commit.step != s or commit.id not in commits:
            problems.append(f"checkpoint {s + 1}: its commit is missing or not in the history")
    leftovers = [p.name for p in store.checkpoints.iterdir() if p.name.startswith(".")]
    leftovers += [str(p) for p in store.checkpoints.glob(f"*/{PENDING_ROLLOUTS}")]
    if leftovers:
        problems.append(f"left over: {leftovers}")
    return problems


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--kill-rate", type=float, default=0.2, help="chance of a kill in each step")
    parser.add_argument("--window", type=int, default=50, help="steps per row of the table")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--path", default="/tmp/artnb-soak/run")
    parser.add_argument("--worker", nargs=2, metavar=("RUN_DIR", "BASE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        asyncio.run(worker(*args.worker))
    else:
        Path(args.path).parent.mkdir(parents=True, exist_ok=True)
        sys.exit(soak(args))
