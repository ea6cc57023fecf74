"""PeftTrainer.train throughput on the embedded SmolLM2-135M, against the least work any LoRA trainer must do.

Workload: LoRA r=8 on all linear layers, 8 sequences x 256 tokens (128 prompt + 128 trainable), fp32 on the CPU,
one `train()` call timed after a warm-up call (the fastest of --repeats), with and without gradient checkpointing.
Baseline ("plain PEFT + HF loss"): the same PEFT model and data, one forward with `labels` (prompt = -100, so
HF's built-in cross-entropy), backward, grad clipping and an AdamW step. It computes logits at every position;
PeftTrainer computes them only where the next token is trainable, so it may beat the baseline.
Baseline and trainer calls alternate, so load from other processes hits both alike. Peak RSS is per run: freed
heap is returned (malloc_trim) and the kernel's high-water mark reset (/proc/self/clear_refs) before one more
call, so one process measures all four; without /proc it falls back to resource.getrusage (process-wide peak).

    python benchmarks/trainer_throughput.py [--sequences 8] [--length 256] [--repeats 1]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import math
import os
import random
import re
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from artnb import models
from artnb.backends.trainers.peft_trainer import PeftTrainer
from artnb.core.config import ALL_LINEAR, LoRAConfig, TrainConfig, TrainerConfig
from artnb.core.tokenize import TokenizedSequence

LORA = LoRAConfig(r=8, alpha=16, target_modules=ALL_LINEAR)
CONFIG = TrainConfig(learning_rate=1e-4)


def reset_peak_rss() -> bool:
    """Give freed heap back to the kernel (glibc keeps it otherwise) and reset the RSS high-water mark."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_gb(reset_worked: bool) -> float:
    if reset_worked:
        with open("/proc/self/status") as f:
            return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) / 1e6
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux


@dataclass
class Measured:
    wall: float = math.inf  # fastest timed call, seconds
    cpu: float = math.inf  # user + system seconds of the fastest-CPU call
    peak_rss_gb: float = math.nan


def measure(steps: dict[str, Callable[[], object]], repeats: int) -> dict[str, Measured]:
    """Warm each step up, then time them in turn `repeats` times (fastest counts), then one call each for memory.

    Alternating the runs gives them the same share of any load from other processes. CPU seconds are less
    disturbed than wall time by such load. Peak RSS comes from separate calls, because handing the heap back
    first makes a call fault its memory in again, which would slow the timed calls.
    """
    results = {name: Measured() for name in steps}
    for step in steps.values():
        step()
    for _ in range(repeats):
        for name, step in steps.items():
            cpu, started = os.times(), time.perf_counter()
            step()
            wall, cpu_end = time.perf_counter() - started, os.times()
            results[name].wall = min(results[name].wall, wall)
            results[name].cpu = min(results[name].cpu, cpu_end.user - cpu.user + cpu_end.system - cpu.system)
    for name, step in steps.items():
        reset = reset_peak_rss()
        step()
        results[name].peak_rss_gb = peak_rss_gb(reset)
    return results


def make_sequences(count: int, length: int, vocab: int) -> list[TokenizedSequence]:
    rng = random.Random(0)
    prompt = length // 2
    return [
        TokenizedSequence(
            token_ids=[rng.randrange(vocab) for _ in range(length)],
            assistant_mask=[j >= prompt for j in range(length)],
            logprobs=[-2.0 if j >= prompt else math.nan for j in range(length)],
            advantage=1.0 if i % 2 else -1.0,
            group_index=0,
            trajectory_index=i,
        )
        for i in range(count)
    ]


def trainer_step(path: str, sequences: list[TokenizedSequence], checkpointing: bool) -> Callable[[], object]:
    trainer = PeftTrainer(path, LORA, TrainerConfig(gradient_checkpointing=checkpointing))
    return lambda: trainer.train(sequences, CONFIG, progress=False)


def baseline_step(path: str, sequences: list[TokenizedSequence], checkpointing: bool) -> Callable[[], object]:
    """One optimizer step of plain PEFT with HF's own loss: forward with labels, backward, clip, AdamW."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model = get_peft_model(
        model, LoraConfig(r=LORA.r, lora_alpha=LORA.alpha, target_modules=LORA.target_modules)
    )
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=CONFIG.learning_rate)
    input_ids = torch.tensor([s.token_ids for s in sequences])
    labels = input_ids.masked_fill(~torch.tensor([s.assistant_mask for s in sequences]), -100)
    attention_mask = torch.ones_like(input_ids)

    def step() -> None:
        out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, use_cache=False)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CONFIG.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1, help="timed calls per run; the fastest counts")
    args = parser.parse_args()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    path = str(models.embedded_model_path())
    sequences = make_sequences(args.sequences, args.length, vocab=49152)
    tokens = args.sequences * args.length
    print(
        f"LoRA r={LORA.r} all-linear, SmolLM2-135M fp32, {args.sequences} x {args.length} tokens "
        f"(half trainable), {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}\n"
    )
    print(f"| {'run':<44} | wall s | tokens/s | CPU s | peak RSS GB | vs baseline (wall, CPU) |")
    print(f"|{'-' * 46}|--------|----------|-------|-------------|-------------------------|")
    for checkpointing in (False, True):
        label = "grad. checkpointing" if checkpointing else "no checkpointing"
        steps = {
            f"baseline: PEFT + HF loss, {label}": baseline_step(path, sequences, checkpointing),
            f"PeftTrainer.train, {label}": trainer_step(path, sequences, checkpointing),
        }
        results = measure(steps, args.repeats)
        base = next(iter(results.values()))
        for name, r in results.items():
            ratio = f"{base.wall / r.wall:.2f}x, {base.cpu / r.cpu:.2f}x"
            print(
                f"| {name:<44} | {r.wall:>6.2f} | {tokens / r.wall:>8.0f} | {r.cpu:>5.1f} | "
                f"{r.peak_rss_gb:>11.2f} | {ratio:>23} |"
            )
        del steps, results
        gc.collect()


if __name__ == "__main__":
    main()
