"""Evaluation games in flight: `art.evaluate(..., max_concurrent=N)` against all games at once.

A multi-turn game's next request reuses its history from the engine's prefix cache only while the cache still
holds it. vLLM on a CPU gets a 512 MiB KV cache (about 11k tokens of the embedded model), so hundreds of
tic-tac-toe games at once push each other's histories out, and every move reads its whole game again.

Baseline: every game at once (`max_concurrent=None`, what `evaluate` does by default). Measured: the same
sampled games of the embedded model (base, vLLM, temperature 1, fixed scenarios) with 16, 32 and 64 in flight;
wall seconds and the ratio of the baseline's seconds to each one's (above 1: faster). Rewards are printed as a
check that similar work was done (sampled, on disjoint scenarios per setting so that no run reuses another's
cached histories; a warm-up caches the first move's prompt, which every game shares).

    python benchmarks/eval_concurrency.py [--games 64] [--samples 4] [--engine vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # runs from a checkout without `pip install -e .`
import artnb as art  # noqa: E402
from artnb.tasks import tic_tac_toe  # noqa: E402

SETTINGS = (None, 16, 32, 64)


async def run(args: argparse.Namespace) -> None:
    shutil.rmtree(args.path, ignore_errors=True)
    model = art.TrainableModel(name="eval-bench", project="bench", base_model=art.models.DEFAULT)
    rows = []
    async with art.LocalBackend(path=args.path, engine=args.engine) as backend:
        await model.register(backend)
        engine = type(backend.engine_of(model)).__name__
        # warm-up: the first move's prompt (the empty board) is the same in every game, cached from here on
        await art.evaluate(
            tic_tac_toe.rollout, {"base": model}, range(8), temperature=1.0, pbar_desc="warm-up"
        )
        for k, max_concurrent in enumerate(SETTINGS):
            scenarios = range(
                1_000_000 + k * args.games, 1_000_000 + (k + 1) * args.games
            )  # no reuse between runs
            t0 = time.monotonic()
            table = await art.evaluate(
                tic_tac_toe.rollout,
                {"base": model},
                scenarios,
                temperature=1.0,
                samples=args.samples,
                max_concurrent=max_concurrent,
                pbar_desc=f"max_concurrent={max_concurrent}",
            )
            rows.append((max_concurrent, time.monotonic() - t0, table["reward"].mean(), len(table)))
    base_s = rows[0][1]
    print(f"\n{args.games} scenarios x {args.samples} sampled tic-tac-toe games, embedded model, {engine}")
    print(f"{'max_concurrent':>14} {'seconds':>8} {'games/s':>8} {'vs all at once':>15} {'mean reward':>12}")
    for max_concurrent, seconds, reward, n in rows:
        label = "all (baseline)" if max_concurrent is None else str(max_concurrent)
        print(f"{label:>14} {seconds:>8.1f} {n / seconds:>8.2f} {base_s / seconds:>14.2f}x {reward:>12.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--games", type=int, default=64, help="held-out scenarios")
    parser.add_argument("--samples", type=int, default=4, help="sampled games per scenario")
    parser.add_argument("--engine", choices=["auto", "vllm", "hf"], default="vllm")
    parser.add_argument("--path", default="/tmp/artnb-eval-concurrency")
    asyncio.run(run(parser.parse_args()))
