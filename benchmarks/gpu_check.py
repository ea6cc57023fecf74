"""One command that checks a CUDA machine end to end, fit to be a release check: it exits 0 only if every part
worked.

    python benchmarks/gpu_check.py             # a CUDA machine: PEFT, and Unsloth where it is installed
    python benchmarks/gpu_check.py --dry-run   # any machine (CI): the CPU-capable parts, on a tiny model

The model has Qwen2.5-1.5B's shape (hidden 1536, 28 layers, 12 heads, 2 KV heads, MLP 8960) with random weights
written on this machine (`artnb.models.random_model`, no hub download) and SmolLM2's tokenizer, hence its
49,152-token vocabulary instead of Qwen's 151,936. Each part runs in a process of its own (Unsloth must be
imported before transformers, and each peak memory is its own), in this order (`--only` picks some):

1. rollouts: the HF engine (its own process, alone on the card) through the OpenAI client against plain
   `model.generate` on the same prompts, 16 and 64 parallel x 64 new tokens (EOS masked until then, so both do
   the same work), best of two, and transformers' own continuous batching (`generate_batch`) where this
   transformers runs it. Targets (issue 25): the engine >= 1.0x generate at 16, >= 2.0x at 64.
2. unsloth, then peft: LocalBackend(trainer=...) with the card's GPU preset; register (engine start and trainer
   load); 3 RL steps of 64 rollouts (2 groups of 32, up to 128 new tokens, rewarded by a hash of the text so
   that a group's rewards differ) and one GRPO step each; after each step the next request must be served by
   the new adapter (`check@N`: hot-load); then a new backend on the same run directory must be at step 3 and
   serve it (resume). Then one realistic trainer batch, the trainer built as LocalBackend builds it: 64
   sequences x 1024 tokens, half trainable, the preset's micro-batch (the second call timed).

Trainer columns: register s; rollout tok/s (completion tokens over the wall time of one batch of rollouts, mean
over the steps); s/step as the first step's and then the mean of the others (the first compiles kernels); RL
step s (rollouts + update, after the first; target: under 10 s); trainer tok/s; MFU; peak GPU memory,
device-wide (engine included), sampled every 0.2 s; hot-load; resume. The realistic batch: s, tok/s, MFU and
the trainer's own max allocated memory.

MFU (model FLOPs utilisation) against the bf16 matmul peak measured on this card (8192 x 8192 matmuls timed with
CUDA events; fp16 on a card without bf16): the FLOPs of the trained tokens per second of the trainer's step,
after the first step. With LoRA a token costs the forward and the backward to the activations (the frozen
weights get no gradient): 2 x (2 x the linear layers' parameters + attention over the mean causal context),
plus the LM head forward and backward at each trained position. Recomputation by gradient checkpointing is not
counted: these are the model's FLOPs, not the hardware's. Target: 35% with Unsloth at the realistic batch.

--dry-run (no GPU needed): the same parts with a 2-layer Qwen2 model, the HF engine and PEFT, one step over 8
rollouts, rollouts at 4 and 8 parallel x 8 tokens (without `generate_batch`), a realistic batch of 8 x 64; it also prints the presets the 1.5B model gets on every card and which trainer "auto" picks here and
why. MFU and GPU memory are n/a there.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zlib
from dataclasses import dataclass, field
from pathlib import Path

SIZE = "1.5B"
LEARNING_RATE = 1e-5
NAME = "check"


@dataclass
class Result:
    """What one trainer's worker process found; written as JSON for the parent's table."""

    trainer: str
    ok: bool = False
    error: str = ""
    card: str = "cpu"
    params: int = 0
    preset: dict | None = None
    peak_tflops: float = math.nan
    engine: str = ""
    register_s: float = math.nan
    rollout_tok_s: list[float] = field(default_factory=list)
    rollout_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    trainer_s: list[float] = field(default_factory=list)
    trainer_tok_s: list[float] = field(default_factory=list)
    flops: list[float] = field(default_factory=list)
    peak_gib: float = math.nan
    hot_load: list[bool] = field(default_factory=list)
    resume: bool = False
    batch: dict = field(default_factory=dict)  # the realistic trainer batch (64 x 1024): s, tok/s, MFU, GiB
    rollout_rows: list[dict] = field(default_factory=list)  # --worker rollouts: engine against generate

    @property
    def mfu(self) -> float:
        """Model FLOPs per trainer second over the measured peak, after the first step when there are more."""
        pairs = list(zip(self.flops, self.trainer_s, strict=True))
        pairs = pairs[1:] or pairs
        if not pairs or not math.isfinite(self.peak_tflops):
            return math.nan
        return sum(f for f, _ in pairs) / sum(s for _, s in pairs) / (self.peak_tflops * 1e12)


# ----- the parent: what to run, and the table ------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dry-run", action="store_true", help="the CPU-capable parts on a tiny model (CI)")
    parser.add_argument("--steps", type=int, help="GRPO steps (3; dry run 1)")
    parser.add_argument("--rollouts", type=int, help="rollouts per step, in 2 groups (16; dry run 8)")
    parser.add_argument("--max-tokens", type=int, help="new tokens per rollout (128; dry run 8)")
    parser.add_argument("--worker", choices=["peft", "unsloth", "rollouts"], help=argparse.SUPPRESS)
    parser.add_argument("--part-s", type=int, default=1200, help="seconds each part may take on a GPU")
    parser.add_argument("--only", help="comma-separated parts to run: rollouts,unsloth,peft (all by default)")
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = args.steps or (1 if args.dry_run else 3)
    args.rollouts = args.rollouts or (8 if args.dry_run else 64)
    args.max_tokens = args.max_tokens or (8 if args.dry_run else 128)
    if args.rollouts < 4 or args.rollouts % 2:
        parser.error("--rollouts: an even number >= 4 (two groups of at least 2)")
    if args.worker:
        return worker(args)

    import torch  # no CUDA context here: the workers own the GPU

    from artnb.backends.trainers.choice import choose_trainer
    from artnb.backends.trainers.unsloth_trainer import unsloth_problem

    on_cuda = torch.cuda.is_available()
    if not on_cuda and not args.dry_run:
        print(
            "gpu_check: no CUDA GPU here. `python benchmarks/gpu_check.py --dry-run` runs the CPU-capable parts."
        )
        return 2
    if args.dry_run:
        print_presets()
    problem = unsloth_problem()
    print(choose_trainer("auto", on_cuda=on_cuda, unsloth_problem=problem)[1])
    parts = ["rollouts"]
    if on_cuda and not args.dry_run:
        if problem is None:
            parts.append("unsloth")
        else:
            print(f"unsloth: not run ({problem})")
    parts.append("peft")
    if args.only:
        parts = [p for p in parts if p in args.only.split(",")]
    results = []
    for part in parts:
        results.append(run_worker(part, args))
        if part == "rollouts":
            print_rollouts(results[-1])
        elif len(parts) > 1:  # each part's rows as soon as it ends, in case a later one overruns
            print_table(results[-1:], dry_run=args.dry_run)
            print_batches(results[-1:])
    failed = bool(on_cuda and not args.dry_run and problem and "not installed" not in problem)
    results = [r for r in results if r.trainer != "rollouts" or not r.ok]
    print_table(results, dry_run=args.dry_run)
    print_batches(results)
    for r in results:
        if r.error:
            print(f"{r.trainer} failed: {r.error}")
    if failed:
        print(f"unsloth is installed but cannot run: {problem}")
    return 0 if all(r.ok for r in results) and not failed else 1


def run_worker(trainer: str, args: argparse.Namespace) -> Result:
    """Run one trainer's checks in a child process; its Result (or the reason it has none)."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, __file__, "--worker", trainer, "--out", str(out)]
        command += ["--steps", str(args.steps), "--rollouts", str(args.rollouts)]
        command += ["--max-tokens", str(args.max_tokens), "--part-s", str(args.part_s)]
        command += ["--dry-run"] if args.dry_run else []
        print(f"--- {trainer}: {' '.join(command[1:])}", flush=True)
        try:
            subprocess.run(command, timeout=600 if args.dry_run else args.part_s, check=False)
        except subprocess.TimeoutExpired:
            if out.is_file():  # what it finished before the time ran out
                return Result(**json.loads(out.read_text()))
            return Result(trainer, error="the worker timed out")
        if not out.is_file():
            return Result(trainer, error="the worker wrote no result (it crashed; see its output above)")
        fields = json.loads(out.read_text())
        return Result(**fields)


def print_presets() -> None:
    from artnb.backends.gpu_presets import CARDS, QWEN2_5, choose_preset

    print(f"GPU presets for Qwen2.5-{SIZE} (backends/gpu_presets.py):")
    for card in CARDS.values():
        p = choose_preset(card, QWEN2_5[SIZE])
        weights = "4-bit" if p.load_in_4bit else "16-bit"
        print(
            f"  {card.name:10} {weights} trainer, vLLM {p.gpu_memory_utilization:.2f} of memory, context "
            f"{p.max_seq_length}, micro-batch {p.micro_batch_tokens} tokens, {p.dtype}"
            + (", eager" if p.enforce_eager else "")
        )


def print_table(results: list[Result], *, dry_run: bool) -> None:
    first = next((r for r in results if r.params), None)
    if first is not None:
        model = "2-layer Qwen2 (dry run)" if dry_run else f"Qwen2.5-{SIZE}-shaped random weights"
        print(f"\nmodel: {model}, {first.params / 1e9:.3g}B parameters; card: {first.card}")
        if first.preset:
            print("preset: " + ", ".join(f"{k}={v}" for k, v in first.preset.items() if v not in ("", None)))
        if math.isfinite(first.peak_tflops):
            print(f"measured matmul peak: {first.peak_tflops:.1f} TFLOP/s")
    print()
    print(
        "| trainer | engine | register s | rollout tok/s | s/step (first, rest) | RL step s | trainer tok/s | MFU | "
        "peak GPU GiB | hot-load | resume |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        steps = r.step_s
        rest = f"{statistics.fmean(steps[1:]):.2f}" if len(steps) > 1 else "-"
        print(
            f"| {r.trainer} | {r.engine or '-'} | {_num(r.register_s, 1)} | "
            f"{_num(statistics.fmean(r.rollout_tok_s) if r.rollout_tok_s else math.nan, 0)} | "
            f"{_num(steps[0], 2) if steps else '-'}, {rest} | {_rl_step(r)} | "
            f"{_num(statistics.fmean(r.trainer_tok_s) if r.trainer_tok_s else math.nan, 0)} | "
            f"{'n/a' if not math.isfinite(r.mfu) else f'{r.mfu:.1%}'} | {_num(r.peak_gib, 1, 'n/a')} | "
            f"{_yes(bool(r.hot_load) and all(r.hot_load))} | {_yes(r.resume)} |"
        )


def _rl_step(r: Result) -> str:
    """Rollouts plus update, the mean over the steps after the first (the first compiles kernels)."""
    pairs = list(zip(r.rollout_s, r.step_s, strict=False))
    pairs = pairs[1:] or pairs
    return _num(statistics.fmean(a + b for a, b in pairs), 2) if pairs else "-"


def _num(value: float, digits: int, missing: str = "-") -> str:
    return f"{value:.{digits}f}" if math.isfinite(value) else missing


def _yes(value: bool) -> str:
    return "ok" if value else "FAILED"


# ----- a worker: one trainer, in its own process ----------------------------------------------------------------


def worker(args: argparse.Namespace) -> int:
    if args.worker == "unsloth":
        import unsloth  # noqa: F401  (before transformers, so that all of Unsloth's patches apply)
    result = Result(args.worker)
    try:
        if args.worker == "rollouts":
            asyncio.run(check_rollouts(args, result))
            result.ok = bool(result.rollout_rows)
        else:
            asyncio.run(check(args, result))
            result.ok = bool(result.hot_load) and all(result.hot_load) and result.resume
            if not result.ok:
                result.error = "hot-load or resume check failed"
    except Exception as error:
        traceback.print_exc()
        result.error = f"{type(error).__name__}: {error}"
    Path(args.out).write_text(json.dumps(dataclasses.asdict(result)))
    return 0 if result.ok else 1


async def check(args: argparse.Namespace, result: Result) -> None:
    import torch

    import artnb as art
    from artnb import models
    from artnb.backends import gpu_presets

    on_cuda = torch.cuda.is_available() and not args.dry_run
    card = gpu_presets.detect_card() if on_cuda else None
    if card is not None:
        result.card = card.name
    shape_config = models.TINY_QWEN2 if not on_cuda else gpu_presets.QWEN2_5[SIZE].config()
    dtype = "float32" if card is None else ("bfloat16" if card.bf16 else "float16")
    base = models.random_model(shape_config, dtype=dtype)
    shape = gpu_presets.model_shape(base)  # the vocabulary is the tokenizer's
    result.params = shape.num_params()
    preset = gpu_presets.preset_for(base, card=card) if card is not None else None
    result.preset = dataclasses.asdict(preset) if preset else None
    if card is not None:
        result.peak_tflops = matmul_peak_flops(torch.bfloat16 if card.bf16 else torch.float16) / 1e12
    memory = PeakMemory() if on_cuda else None
    options = {"engine": "hf" if args.dry_run else "auto", "trainer": args.worker}
    micro = preset.micro_batch_tokens if preset else 2048
    with tempfile.TemporaryDirectory(prefix="gpu-check-run-") as run_dir:
        model = art.TrainableModel(name=NAME, project="gpu-check", base_model=base)
        started = time.perf_counter()
        async with art.LocalBackend(path=run_dir, **options) as backend:
            await model.register(backend)
            result.register_s = time.perf_counter() - started
            result.engine = type(backend.engine_of(model)).__name__
            for step in range(args.steps):
                groups, tokens, seconds = await rollouts(model, args.rollouts, args.max_tokens, seed=step)
                result.rollout_tok_s.append(tokens / seconds)
                result.rollout_s.append(seconds)
                started = time.perf_counter()
                trained = await model.train(groups, learning_rate=LEARNING_RATE, micro_batch_tokens=micro)
                result.step_s.append(time.perf_counter() - started)
                record_trainer(result, trained.metrics, shape)
                result.hot_load.append(await served_by(model) == f"{NAME}@{trained.step}")
        resumed = art.TrainableModel(name=NAME, project="gpu-check", base_model=base)
        async with art.LocalBackend(path=run_dir, **options) as backend:
            await resumed.register(backend)
            step = await resumed.get_step()
            result.resume = step == args.steps and await served_by(resumed) == f"{NAME}@{args.steps}"
    if memory is not None:
        result.peak_gib = memory.stop() / 2**30
    result.batch = trainer_batch(args.worker, base, preset, shape, on_cuda, result.peak_tflops)


def trainer_batch(kind: str, base: str, preset, shape, on_cuda: bool, peak_tflops: float) -> dict:
    """One realistic trainer batch, as LocalBackend builds the trainer (the card's preset, the trainer's own
    memory defaults): 64 sequences x 1024 tokens, half trainable (dry run: 8 x 64). The second call is timed."""
    import torch
    from trainer_throughput import make_sequences  # this directory's: random tokens, half trainable

    from artnb.backends.trainers.choice import make_trainer
    from artnb.core.config import LoRAConfig, TrainConfig, TrainerConfig

    count, length = (64, 1024) if on_cuda else (8, 64)
    sequences = make_sequences(count, length, shape.vocab_size)
    trainer = make_trainer(kind, base, LoRAConfig(), TrainerConfig(), preset)
    micro = preset.micro_batch_tokens if preset else 2048
    config = TrainConfig(learning_rate=LEARNING_RATE, micro_batch_tokens=micro)
    trainer.train(sequences, config)  # the first call compiles kernels
    if on_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    trainer.train(sequences, config)
    if on_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    tokens = count * length
    flops = tokens * shape.training_flops_per_token(length / 2) + tokens / 2 * shape.head_flops_per_position()
    checkpointing = getattr(getattr(trainer, "config", None), "gradient_checkpointing", None)
    return {
        "sequences": f"{count} x {length}",
        "micro_batch_tokens": micro,
        "checkpointing": "always" if kind == "unsloth" else checkpointing,
        "s": seconds,
        "tok_s": tokens / seconds,
        "mfu": flops / seconds / (peak_tflops * 1e12) if math.isfinite(peak_tflops) else math.nan,
        "gib": torch.cuda.max_memory_allocated() / 2**30 if on_cuda else math.nan,
    }


async def check_rollouts(args: argparse.Namespace, result: Result) -> None:
    """The HF engine through the OpenAI client against plain `generate` on the same prompts, 64 new tokens each
    (EOS masked until then), at 16 and 64 parallel; and transformers' own continuous batching (`generate_batch`)
    where it runs. Engine first, alone on the card; then generate in this process."""
    import openai
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from artnb import models
    from artnb.backends import gpu_presets
    from artnb.backends.engines.hf.client import HFEngine

    on_cuda = torch.cuda.is_available() and not args.dry_run
    card = gpu_presets.detect_card() if on_cuda else None
    result.card = card.name if card else "cpu"
    shape_config = models.TINY_QWEN2 if not on_cuda else gpu_presets.QWEN2_5[SIZE].config()
    dtype = "float32" if card is None else ("bfloat16" if card.bf16 else "float16")
    base = models.random_model(shape_config, dtype=dtype)
    result.params = gpu_presets.model_shape(base).num_params()
    tokens, batches = (64, (16, 64)) if on_cuda else (8, (4, 8))
    tokenizer = AutoTokenizer.from_pretrained(base, padding_side="left")
    prompts = [
        [{"role": "user", "content": f"Tell a story about the number {i}, in {i % 5 + 2} sentences."}]
        for i in range(max(batches))
    ]
    rows: dict[int, dict] = {b: {"parallel": b, "tokens": tokens} for b in batches}
    with tempfile.TemporaryDirectory(prefix="gpu-check-logs-") as logs:
        engine = HFEngine(
            base, "check", logs, device="cuda" if on_cuda else "cpu", max_batch_size=max(batches)
        )
        memory = PeakMemory() if on_cuda else None
        await engine.start()
        client = openai.AsyncOpenAI(base_url=engine.base_url, api_key=engine.api_key, max_retries=0)

        async def engine_run(batch: int) -> float:
            async def one(messages) -> int:
                completion = await client.chat.completions.create(
                    model="check", messages=messages, max_tokens=tokens, temperature=1.0,
                    extra_body={"min_tokens": tokens},
                )  # fmt: skip
                return completion.usage.completion_tokens

            started = time.perf_counter()
            counts = await asyncio.gather(*(one(m) for m in prompts[:batch]))
            return sum(counts) / (time.perf_counter() - started)

        try:
            await engine_run(4)  # warm-up
            for batch in batches:
                rows[batch]["engine"] = max([await engine_run(batch) for _ in range(2)])
        finally:
            await engine.stop()
        if memory is not None:
            result.peak_gib = memory.stop() / 2**30
    device = "cuda" if on_cuda else "cpu"
    model = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, dtype)).to(device).eval()
    texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in prompts]

    def generate_run(batch: int) -> float:
        inputs = tokenizer(texts[:batch], return_tensors="pt", padding=True, add_special_tokens=False).to(
            device
        )
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                **inputs, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=tokenizer.eos_token_id,
            )  # fmt: skip
        if on_cuda:
            torch.cuda.synchronize()
        return (out.shape[1] - inputs["input_ids"].shape[1]) * batch / (time.perf_counter() - started)

    generate_run(4)
    for batch in batches:
        rows[batch]["generate"] = max(generate_run(batch) for _ in range(2))
        rows[batch]["continuous"] = math.nan
    result.rollout_rows = list(rows.values())
    result.ok = True
    Path(args.out).write_text(json.dumps(dataclasses.asdict(result)))  # kept if the last part overruns
    for batch in batches if on_cuda else ():  # on a CPU it makes 2-4 tokens/s: minutes of CI for nothing
        rows[batch]["continuous"] = continuous_batching(model, tokenizer, texts[:batch], tokens, rows[batch])
    result.rollout_rows = list(rows.values())


def continuous_batching(model, tokenizer, texts: list[str], tokens: int, row: dict) -> float:
    """transformers' `generate_batch` (continuous batching, paged attention) on the same prompts; NaN (and the
    reason in `row`) where this transformers cannot run it."""
    from transformers import GenerationConfig

    try:
        ids = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
        config = GenerationConfig(
            max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            eos_token_id=-1, pad_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
        model.generate_batch(inputs=ids[:2], generation_config=config, progress_bar=False)  # warm-up
        started = time.perf_counter()
        out = model.generate_batch(inputs=ids, generation_config=config, progress_bar=False)
        produced = sum(len(o.generated_tokens) for o in out.values())
        return produced / (time.perf_counter() - started)
    except Exception as error:  # an API that moved between transformers versions
        row["continuous_error"] = f"{type(error).__name__}: {str(error)[:160]}"
        return math.nan


def print_rollouts(result: Result) -> None:
    if not result.rollout_rows:
        print(f"rollouts: {result.error or 'no rows'}")
        return
    print(
        f"\nrollouts on {result.card}, {result.params / 1e9:.3g}B parameters (tokens/s, ratio against generate):"
    )
    print(
        "| parallel x new tokens | HF engine (OpenAI client) | model.generate | ratio | generate_batch (CB) | ratio |"
    )
    print("|---|---|---|---|---|---|")
    for r in result.rollout_rows:
        g = r["generate"]
        print(
            f"| {r['parallel']} x {r['tokens']} | {r['engine']:.0f} | {g:.0f} | {r['engine'] / g:.2f} | "
            f"{_num(r['continuous'], 0)} | {_num(r['continuous'] / g, 2)} |"
        )
        if "continuous_error" in r:
            print(f"  generate_batch: {r['continuous_error']}")
    print(f"engine process peak GPU memory (device-wide): {_num(result.peak_gib, 1, 'n/a')} GiB")


def print_batches(results: list[Result]) -> None:
    rows = [r for r in results if r.batch]
    if not rows:
        return
    print(
        "\n| trainer, realistic batch | sequences | micro-batch tokens | checkpointing | s/step | tok/s | MFU | max allocated GiB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        b = r.batch
        mfu = "n/a" if not math.isfinite(b["mfu"]) else f"{b['mfu']:.1%}"
        print(
            f"| {r.trainer} | {b['sequences']} | {b['micro_batch_tokens']} | {b['checkpointing']} | {b['s']:.2f} | "
            f"{b['tok_s']:.0f} | {mfu} | {_num(b['gib'], 1, 'n/a')} |"
        )


def record_trainer(result: Result, metrics: dict, shape) -> None:
    """The step's trainer time, tokens/s and model FLOPs (see the module docstring), from its metrics."""
    seconds = metrics.get("train/seconds")
    if not seconds:  # equal rewards everywhere: the step advanced without an update
        return
    tokens = metrics["train/tokens_per_second"] * seconds
    context = tokens / metrics["train/num_sequences"] / 2
    flops = tokens * shape.training_flops_per_token(context)
    flops += metrics["train/num_trainable_tokens"] * shape.head_flops_per_position()
    result.trainer_s.append(seconds)
    result.trainer_tok_s.append(metrics["train/tokens_per_second"])
    result.flops.append(flops)


async def rollouts(model, count: int, max_tokens: int, seed: int):
    """`count` chat rollouts in 2 groups, rewarded by a hash of the text; (groups, completion tokens, seconds)."""
    import artnb as art

    client = model.openai_client()

    async def one(i: int):
        messages = [{"role": "user", "content": f"Tell a story about the number {seed * 1000 + i}."}]
        completion = await client.chat.completions.create(
            model=model.get_inference_name(),
            messages=messages,
            max_tokens=max_tokens,
            temperature=1.0,
            seed=seed * 1000 + i,
        )
        choice = completion.choices[0]
        reward = zlib.crc32((choice.message.content or "").encode()) / 2**32
        trajectory = art.Trajectory(messages_and_choices=[*messages, choice], reward=reward)
        return trajectory, completion.usage.completion_tokens

    started = time.perf_counter()
    done = await asyncio.gather(*(one(i) for i in range(count)))
    seconds = time.perf_counter() - started
    half = count // 2
    groups = [
        art.TrajectoryGroup([t for t, _ in done[:half]]),
        art.TrajectoryGroup([t for t, _ in done[half:]]),
    ]
    return groups, sum(n for _, n in done), seconds


async def served_by(model) -> str:
    """The adapter that serves the plain model name now (the newest loaded step)."""
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    return completion.model


def matmul_peak_flops(dtype, n: int = 8192, repeats: int = 30) -> float:
    """FLOP/s of n x n matmuls in `dtype` on this GPU, timed with CUDA events after a warm-up."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    for _ in range(3):
        c = a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        c = a @ b
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000
    del a, b, c
    torch.cuda.empty_cache()
    return 2 * n**3 * repeats / seconds


class PeakMemory:
    """Device-wide GPU memory in use (every process: trainer and engine), its peak sampled in a thread."""

    def __init__(self, interval_s: float = 0.2) -> None:
        import torch

        self._torch, self.peak, self._stop = torch, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.is_set():
            free, total = self._torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free)
            self._stop.wait(interval_s)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


if __name__ == "__main__":
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    sys.exit(main())
