"""Where one RL step's time goes: tic-tac-toe on the embedded model, broken into its parts.

A step is the gather (16 games: 2 groups of 8, each game up to five one-move chat requests) and the train call.
- Rollouts: each request's latency as the client sees it; on the vLLM engine also the server's own split of
  each request into queueing, prefill and decode, and how much of the prompts the prefix cache served (vLLM's
  Prometheus metrics).
- The train call: each phase of the step transaction (train_step.py, timed from the "artnb" logger's phase
  records), and inside "train" the trainer's split into prepare / forward / backward / optimizer
  (`PeftTrainer.last_timings`).
Baseline: the whole step; each part is printed in seconds per step and as a share of it, averaged over the
steps after the first (the first pays for warm-up).

`--decoding slots|dynamic` picks the HF engine's decoding (hf/slots.py; the engine's default is slots).

    python benchmarks/step_profile.py [--steps 4] [--engine auto|vllm|hf] [--no-merge] [--decoding slots|dynamic]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import shutil
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import httpx

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # runs from a checkout without `pip install -e .`
import artnb as art  # noqa: E402
from artnb.backends.train_step import PHASES  # noqa: E402
from artnb.tasks import tic_tac_toe  # noqa: E402

_SAMPLE = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})? ([0-9.eE+-]+|NaN)$")
SERVER_SPLIT = {  # what vLLM's histograms hold, summed over requests
    "queue": "vllm:request_queue_time_seconds_sum",
    "prefill": "vllm:request_prefill_time_seconds_sum",
    "decode": "vllm:request_decode_time_seconds_sum",
    "first token": "vllm:time_to_first_token_seconds_sum",
}


class PhaseClock(logging.Handler):
    """Seconds spent in each phase of the train call, from the phase records train_step.py logs at DEBUG."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.marks: list[tuple[str, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        phase = getattr(record, "artnb_phase", None)
        if phase is not None:
            self.marks.append((phase, time.monotonic()))

    def durations(self, end: float) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for (phase, start), (_, stop) in zip(self.marks, [*self.marks[1:], ("end", end)], strict=True):
            out[phase] += stop - start
        self.marks.clear()
        return out


class RequestClock:
    """Each chat request's latency as the rollout sees it (wraps the client's `chat.completions.create`)."""

    def __init__(self, client) -> None:
        self.latencies: list[float] = []
        create = client.chat.completions.create

        async def timed(*args, **kwargs):
            started = time.monotonic()
            try:
                return await create(*args, **kwargs)
            finally:
                self.latencies.append(time.monotonic() - started)

        client.chat.completions.create = timed

    def take(self) -> list[float]:
        out, self.latencies = self.latencies, []
        return out


async def server_counters(engine) -> dict[str, float]:
    """vLLM's Prometheus counters and histogram sums, summed over label sets; {} for the HF engine."""
    if type(engine).__name__ != "VLLMEngine":
        return {}
    root = engine.base_url.removesuffix("/v1")
    async with httpx.AsyncClient(timeout=30) as client:
        text = (
            await client.get(f"{root}/metrics", headers={"Authorization": f"Bearer {engine.api_key}"})
        ).text
    out: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if (m := _SAMPLE.match(line)) and m[2] != "NaN":
            out[m[1]] += float(m[2])
    return out


def server_split(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    if not after:
        return {}
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    out = {part: delta.get(name, 0.0) for part, name in SERVER_SPLIT.items()}
    out["prompt tokens"] = delta.get("vllm:prompt_tokens_total", 0.0)
    queries = delta.get("vllm:prefix_cache_queries_total", 0.0)
    out["prefix cache hit rate"] = (
        delta.get("vllm:prefix_cache_hits_total", 0.0) / queries if queries else 0.0
    )
    out["generated tokens"] = delta.get("vllm:generation_tokens_total", 0.0)
    return out


async def run(args: argparse.Namespace) -> None:
    settings = art.tutorial.Settings(quick=False, path=args.path, groups_per_step=2, group_size=8)
    model = art.TrainableModel(name="profile", project="step-profile", base_model=settings.base_model)
    options: dict = {"merge_newest": False} if args.no_merge else {}
    if args.decoding:
        options["decoding"] = args.decoding
    artnb_log = logging.getLogger("artnb")
    artnb_log.setLevel(logging.DEBUG)
    phases = PhaseClock()
    artnb_log.addHandler(phases)
    async with settings.backend(engine=args.engine, engine_options=options) as backend:
        t0 = time.monotonic()
        await model.register(backend)
        engine, trainer = backend.engine_of(model), backend.trainer_of(model)
        print(f"registered on {type(engine).__name__} in {time.monotonic() - t0:.0f}s", flush=True)
        requests = RequestClock(model.openai_client())
        steps = []
        for step in range(args.steps):
            before = await server_counters(engine)
            started = time.monotonic()
            groups = await art.gather_trajectory_groups(
                (
                    art.TrajectoryGroup(tic_tac_toe.rollout(model, s) for _ in range(settings.group_size))
                    for s in settings.scenarios(step)
                ),
                pbar_desc=f"step {step} rollouts",
            )
            gathered = time.monotonic()
            split = server_split(before, await server_counters(engine))
            latencies = requests.take()
            phases.marks.clear()
            await model.train(groups, config=settings.train_config())
            done = time.monotonic()
            steps.append(
                {
                    "rollouts": gathered - started,
                    "requests": latencies,
                    "server": split,
                    "train call": done - gathered,
                    "phases": phases.durations(done),
                    # absent in commits before the trainer's split (to profile main as it was)
                    "trainer": dict(getattr(trainer, "last_timings", {})),
                }
            )
            print(
                f"step {step}: rollouts {gathered - started:.1f}s ({len(latencies)} requests), "
                f"train {done - gathered:.1f}s",
                flush=True,
            )
    report(steps[1:] if len(steps) > 1 else steps, type(engine).__name__, args)


def report(steps: list[dict], engine: str, args: argparse.Namespace) -> None:
    def mean(get) -> float:
        return statistics.fmean(get(s) for s in steps)

    total = mean(lambda s: s["rollouts"] + s["train call"])
    rows: list[tuple[str, float | None, str]] = [("step (baseline)", total, "")]
    requests = [x for s in steps for x in s["requests"]]
    rows.append(
        ("rollouts (gather)", mean(lambda s: s["rollouts"]), f"{len(requests) / len(steps):.0f} requests")
    )
    rows.append(
        (
            "  request latency, client",
            None,
            f"mean {statistics.fmean(requests) * 1000:.0f} ms, p50 {statistics.median(requests) * 1000:.0f}, "
            f"max {max(requests) * 1000:.0f}",
        )
    )
    if steps[0]["server"]:
        n = len(requests) / len(steps)
        for part in SERVER_SPLIT:
            per = mean(lambda s, p=part: s["server"][p]) / n
            rows.append((f"  server {part}, per request", None, f"{per * 1000:.0f} ms"))
        rows.append(
            (
                "  prompt tokens / prefix-cache hits",
                None,
                f"{mean(lambda s: s['server']['prompt tokens']):.0f} per step, "
                f"{mean(lambda s: s['server']['prefix cache hit rate']):.0%} served from cache",
            )
        )
    rows.append(("train call", mean(lambda s: s["train call"]), ""))
    for phase in PHASES:
        seconds = mean(lambda s, p=phase: s["phases"].get(p, 0.0))
        rows.append((f"  {phase}", seconds, ""))
        if phase == "train":
            for part in ("prepare", "precalculate", "forward", "backward", "optimizer"):
                rows.append((f"    trainer {part}", mean(lambda s, p=part: s["trainer"].get(p, 0.0)), ""))
    print(
        f"\nstep profile: tic-tac-toe, 2 groups x 8 games, embedded model, {engine}, merge "
        f"{'off' if args.no_merge else 'default'}{f', decoding {args.decoding}' if args.decoding else ''}; "
        f"mean of {len(steps)} step(s) after the first"
    )
    print(f"{'part':<38} {'s/step':>8} {'share':>7}  note")
    for name, seconds, note in rows:
        if seconds is None:
            print(f"{name:<38} {'':>8} {'':>7}  {note}")
        else:
            print(f"{name:<38} {seconds:>8.2f} {seconds / total:>7.0%}  {note}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--engine", choices=["auto", "vllm", "hf"], default="auto")
    parser.add_argument("--no-merge", action="store_true", help="serve the newest adapter as LoRA")
    parser.add_argument(
        "--decoding", choices=["slots", "dynamic"], help="the HF engine's decoding (default: the engine's)"
    )
    parser.add_argument("--path", default="/tmp/artnb-step-profile")
    args = parser.parse_args()
    if args.decoding and args.engine != "hf":
        parser.error("--decoding is the HF engine's: pass --engine hf with it")
    shutil.rmtree(args.path, ignore_errors=True)
    asyncio.run(run(args))
