"""PeftTrainer.train throughput on the embedded SmolLM2-135M, against the least work any LoRA trainer must do.

Workload: LoRA r=8 on all linear layers, 8 sequences x 256 tokens (128 prompt + 128 trainable), fp32 on the CPU,
one `train()` call timed after a warm-up call, with and without gradient checkpointing.
Baseline ("plain PEFT + HF loss"): the same PEFT model and data, one forward with `labels` (prompt = -100, so
HF's built-in cross-entropy), backward, grad clipping and an AdamW step. It computes logits at every position;
PeftTrainer computes them only where the next token is trainable, so it may beat the baseline.
Peak RSS is per run: freed heap is returned (malloc_trim) and the kernel's high-water mark reset
(/proc/self/clear_refs) before one more call, so one process can measure all four; without /proc it falls back
to resource.getrusage (the process-wide peak).

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


def timed(step: Callable[[], object], repeats: int) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds, peak RSS in GB) of `step`: a warm-up call, `repeats` timed calls (the fastest
    counts), then one call for memory.

    CPU seconds (user + system) are less disturbed than wall time when other processes share the cores. The
    peak RSS comes from a separate call because giving the heap back first makes that call fault it in again.
    """
    step()
    best_wall, best_cpu = math.inf, math.inf
    for _ in range(repeats):
        cpu, started = os.times(), time.perf_counter()
        step()
        wall, cpu_end = time.perf_counter() - started, os.times()
        best_wall = min(best_wall, wall)
        best_cpu = min(best_cpu, cpu_end.user - cpu.user + cpu_end.system - cpu.system)
    reset = reset_peak_rss()
    step()
    return best_wall, best_cpu, peak_rss_gb(reset)


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


def run_trainer(
    path: str, sequences: list[TokenizedSequence], checkpointing: bool, repeats: int
) -> tuple[float, float, float]:
    trainer = PeftTrainer(path, LORA, TrainerConfig(gradient_checkpointing=checkpointing))
    return timed(lambda: trainer.train(sequences, CONFIG, progress=False), repeats)


def run_baseline(
    path: str, sequences: list[TokenizedSequence], checkpointing: bool, repeats: int
) -> tuple[float, float, float]:
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
        model(
            input_ids=input_ids, attention_mask=attention_mask, labels=labels, use_cache=False
        ).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CONFIG.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return timed(step, repeats)


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
        f"(half trainable), {torch.get_num_threads()} threads\n"
    )
    rows = []
    for checkpointing in (False, True):
        label = "grad. checkpointing" if checkpointing else "no checkpointing"
        baseline = run_baseline(path, sequences, checkpointing, args.repeats)
        rows.append((f"baseline: plain PEFT + HF loss, {label}", baseline, baseline))
        rows.append(
            (
                f"PeftTrainer.train, {label}",
                run_trainer(path, sequences, checkpointing, args.repeats),
                baseline,
            )
        )
    print(f"| {'run':<52} | wall s | tokens/s | CPU s | peak RSS GB | vs baseline (wall) |")
    print(f"|{'-' * 54}|--------|----------|-------|-------------|--------------------|")
    for name, (wall, cpu, rss), (base_wall, _, _) in rows:
        print(
            f"| {name:<52} | {wall:>6.2f} | {tokens / wall:>8.0f} | {cpu:>5.1f} | {rss:>11.2f} | {base_wall / wall:>17.2f}x |"
        )


if __name__ == "__main__":
    main()
