"""What does training through `artnb serve` cost? RemoteBackend against LocalBackend, same machine, same task.

Each RL step gathers 2 groups x 8 rollouts (each samples exactly `--tokens` tokens: temperature 1, min_tokens =
max_tokens, so both sides do the same work) and trains on them (lr 1e-3, rewards by length of the first word,
so every group has something to learn). LocalBackend runs the engine and the trainer in this process's
children; RemoteBackend sends the same calls to `artnb serve` on 127.0.0.1 (a subprocess): rollouts go through
the server's proxy, the batch crosses the wire as JSON, the phases stream back, and the local mirror is synced
after each step. Both use the same engine (`--engine`, HF by default: it starts in seconds) and the same base
model: the embedded SmolLM2-135M by default, whose step costs what a real (small) step costs; `--model tiny`
(a 2-layer random model) makes the step almost free, so the fixed remote cost shows as a worst case.

One warm-up step each (engine and trainer first-use costs), then `--steps` timed steps; medians are printed.
Target: remote <= 1.10x local seconds per step.

    python benchmarks/remote_overhead.py [--model embedded|tiny] [--steps 5] [--tokens 32] [--engine hf]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # runs from a checkout without `pip install -e .`
import artnb as art  # noqa: E402
from artnb.backends.ports import free_port
from artnb.backends.remote import RemoteBackend  # noqa: E402
from artnb.models import DEFAULT, tiny  # noqa: E402

SUBJECTS = [
    "a cat",
    "the sea",
    "a robot",
    "an old ship",
    "a tall tree",
    "a river",
    "a lazy king",
    "a small bird",
]


async def rollout(
    model: art.TrainableModel, subject: str, seed: int, tokens: int
) -> tuple[art.Trajectory, int]:
    messages = [{"role": "user", "content": f"Write one sentence about {subject}."}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(),
        messages=messages,
        max_tokens=tokens,
        temperature=1.0,
        seed=seed,
        extra_body={"min_tokens": tokens},
    )
    choice = completion.choices[0]
    words = (choice.message.content or "").split()
    reward = min(len(words[0]), 10) / 10 if words else 0.0
    return art.Trajectory(
        messages_and_choices=[*messages, choice], reward=reward
    ), completion.usage.completion_tokens


async def one_step(model: art.TrainableModel, step: int, tokens: int) -> dict[str, float]:
    started = time.perf_counter()
    results = await asyncio.gather(
        *(rollout(model, SUBJECTS[(step + g) % len(SUBJECTS)], step * 100 + g * 10 + i, tokens)
          for g in range(2) for i in range(8))
    )  # fmt: skip
    gathered = time.perf_counter()
    groups = [art.TrajectoryGroup([t for t, _ in results[g * 8 : (g + 1) * 8]]) for g in range(2)]
    for g in groups:  # equal rewards would skip the update; keep the work the same on both sides
        g.trajectories[0].reward, g.trajectories[1].reward = 1.0, 0.0
    await model.train(groups, config=art.TrainConfig(learning_rate=1e-3))
    done = time.perf_counter()
    return {
        "step": done - started,
        "gather": gathered - started,
        "train": done - gathered,
        "tok_s": sum(n for _, n in results) / (gathered - started),
    }


async def measure(backend, base: str, steps: int, tokens: int, name: str) -> dict[str, float]:
    model = art.TrainableModel(name=name, project="bench", base_model=base)
    await model.register(backend)
    await one_step(model, 0, tokens)  # warm-up
    runs = [await one_step(model, s, tokens) for s in range(1, steps + 1)]
    await backend.close()
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def start_server(path: Path, port: int, key: str, engine: str, log: Path) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "artnb.cli",
        "serve",
        "--path",
        str(path),
        "--port",
        str(port),
        "--engine",
        engine,
    ]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, env={**os.environ, "ARTNB_API_KEY": key}, stdout=out, stderr=out)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"artnb serve exited:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError("artnb serve did not start")


async def main(args: argparse.Namespace) -> None:
    base = DEFAULT if args.model == "embedded" else tiny(hidden_size=64, num_layers=2, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        local = await measure(
            art.LocalBackend(tmp / "local", engine=args.engine), base, args.steps, args.tokens, "local"
        )
        key, port = secrets.token_urlsafe(16), free_port()
        server = start_server(tmp / "served", port, key, args.engine, tmp / "server.log")
        try:
            backend = RemoteBackend(f"http://127.0.0.1:{port}", api_key=key, path=tmp / "mirror")
            remote = await measure(backend, base, args.steps, args.tokens, "remote")
        finally:
            server.terminate()
            server.wait(timeout=60)
    print(
        f"\nRemoteBackend vs LocalBackend: {args.model} model, {args.engine} engine, 2 groups x 8 rollouts x "
        f"{args.tokens} tokens per step, median of {args.steps} steps, {os.cpu_count()} CPU cores\n"
    )
    print("| backend | s/step | gather s | train s | rollout tok/s |")
    print("|---|---|---|---|---|")
    for label, r in (("LocalBackend", local), ("RemoteBackend", remote)):
        print(f"| {label} | {r['step']:.2f} | {r['gather']:.2f} | {r['train']:.2f} | {r['tok_s']:.0f} |")
    print(
        f"| remote / local | {remote['step'] / local['step']:.3f}x | {remote['gather'] / local['gather']:.3f}x | "
        f"{remote['train'] / local['train']:.3f}x | {remote['tok_s'] / local['tok_s']:.3f}x |"
    )
    verdict = "meets" if remote["step"] <= 1.10 * local["step"] else "MISSES"
    print(
        f"\nremote s/step is {remote['step'] / local['step'] - 1:+.1%} vs local: {verdict} the <= +10% target"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["embedded", "tiny"], default="embedded")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per backend (after one warm-up)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens sampled per rollout")
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    asyncio.run(main(parser.parse_args()))
