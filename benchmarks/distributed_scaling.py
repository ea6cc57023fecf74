"""Seconds per trainer step at 1 and 2 FSDP ranks on the same batch, against the single-process PeftTrainer.

Workload: a random Llama (`artnb.models.tiny`, --hidden/--layers), LoRA r=8 on the attention projections,
--sequences sequences of --length tokens (the second half trainable), one GRPO `train()` call per step; the median
of --steps steps after one warm-up step. The FSDP trainer's ranks are processes on this machine: gloo on the CPU,
nccl with one GPU each where there are GPUs (--device). On a CPU the ranks share its cores, so 2 ranks show the
cost of sharding and of the collectives, not a speed-up; the speed-up is for GPUs, one per rank. The last
column is each rank's peak resident host memory (VmHWM, Linux): rank 0 reads the weights, the others receive
their shards, so only rank 0 ever holds the whole model.

    python benchmarks/distributed_scaling.py [--hidden 256] [--layers 4] [--sequences 16] [--length 128]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from artnb import models
from artnb.backends.trainers.fsdp_trainer import FsdpTrainer
from artnb.backends.trainers.peft_trainer import PeftTrainer
from artnb.core.config import LoRAConfig, TrainConfig, TrainerConfig
from artnb.core.tokenize import TokenizedSequence

LORA = LoRAConfig(r=8, alpha=16)
CONFIG = TrainConfig(learning_rate=1e-4)


def batch(count: int, length: int, seed: int = 0) -> list[TokenizedSequence]:
    rng = random.Random(seed)
    return [
        TokenizedSequence(
            token_ids=[rng.randrange(100, 40000) for _ in range(length)],
            assistant_mask=[j >= length // 2 for j in range(length)],
            logprobs=[float("nan")] * length,
            advantage=1.0 if i % 2 else -1.0,
            group_index=0,
            trajectory_index=i,
        )
        for i in range(count)
    ]


def seconds_per_step(trainer, sequences: list[TokenizedSequence], steps: int) -> float:
    trainer.train(sequences, CONFIG, progress=False)  # warm-up
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        trainer.train(sequences, CONFIG, progress=False)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def peak_host_mib(pid: int) -> float:
    """The peak resident memory of process `pid` in MiB (Linux's VmHWM)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    args = parser.parse_args()
    base = models.tiny(hidden_size=args.hidden, num_layers=args.layers)
    sequences = batch(args.sequences, args.length)
    config = TrainerConfig(device=args.device)

    rows = [
        (
            "PeftTrainer (1 process)",
            seconds_per_step(PeftTrainer(base, LORA, config), sequences, args.steps),
            "",
        )
    ]
    for ranks in (1, 2):
        trainer = FsdpTrainer(base, LORA, config, ranks=ranks)
        try:
            seconds = seconds_per_step(trainer, sequences, args.steps)
            memory = " / ".join(f"{peak_host_mib(pid):.0f}" for pid in trainer.rank_pids())
            rows.append((f"FsdpTrainer, {ranks} rank{'s' if ranks > 1 else ''}", seconds, memory))
        finally:
            trainer.close()

    one_rank = rows[1][1]
    print(
        f"\n{args.sequences} sequences x {args.length} tokens, tiny Llama h{args.hidden} x {args.layers} layers, "
        f"median of {args.steps} steps"
    )
    # speed-up against 1 FSDP rank: its seconds per step over this row's (the GPU target: >= 1.7x at 2)
    print(f"{'trainer':<26} {'s/step':>8} {'speed-up vs 1 rank':>19}  host peak MiB per rank")
    for name, seconds, memory in rows:
        print(f"{name:<26} {seconds:>8.3f} {one_rank / seconds:>18.2f}x  {memory}")


if __name__ == "__main__":
    main()
