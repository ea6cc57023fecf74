"""One command that checks a CUDA machine end to end, fit to be a release check: it exits 0 only if every part
worked.

    python benchmarks/gpu_check.py             # a CUDA machine: PEFT, and Unsloth where it is installed
    python benchmarks/gpu_check.py --dry-run   # any machine (CI): the CPU-capable parts, on a tiny model

The model has Qwen2.5-1.5B's shape (hidden 1536, 28 layers, 12 heads, 2 KV heads, MLP 8960) with random weights
written on this machine (`artnb.models.random_model`, no hub download) and SmolLM2's tokenizer, hence its
49,152-token vocabulary instead of Qwen's 151,936. Each part runs in a process of its own (Unsloth must be
imported before transformers, and each peak memory is its own), in this order (`--only` picks some):

1. fsdp: the FSDP trainer's GPU path (FsdpTrainer: nccl, bf16, FSDP2) on a Qwen2.5-0.5B-shaped random model
   against PeftTrainer, the single-process trainer, as the baseline: one GRPO step on the same batch (64 x 512
   tokens, half trainable, micro-batch 4096) from the same checkpoint, at 1 rank and, with 2 GPUs, at 2 ranks.
   Reported: the largest difference of any LoRA weight after the step, in units of the learning rate (an AdamW
   step moves a weight by at most about the learning rate: |m^|/sqrt(v^) <= 1 on the step after the warm-up
   step whose moments both sides load), the grad_norm's relative difference (AdamW hides a gradient's scale,
   the norm does not), the update's relative L2 difference (information); seconds per step (median of 3 after
   one warm-up step) and the speed against PeftTrainer and against 1 rank (target, issue 30: >= 1.7x at 2
   ranks); checkpoints both ways (FsdpTrainer.save_checkpoint -> PeftTrainer.load_checkpoint and back) must
   give the same tensors bit for bit; peak GPU memory per rank, device-wide and sampled (see `check_fsdp`).
   About a minute on one GPU (two rank groups start); a failure or a hang (the part stops itself after
   FSDP_BUDGET_S) is reported with the ranks' log tails and the other parts still run.
2. rollouts: the HF engine (its own process, alone on the card) through the OpenAI client, once per decoding
   (its slots with CUDA graphs, the default; the slots eager; the dynamic cache) and vLLM where it is
   installed, against plain `model.generate` on the same prompts, 16 and 64 parallel x 64 new tokens (EOS masked
   until then, so both do the same work), best of two, and transformers' own continuous batching
   (`generate_batch`) where this transformers runs it; each engine's start check and graph captures; and, in
   this process, replayed graphs against eager slot steps (the same tokens and logprobs, bit for bit). Targets
   (issue 25): the engine >= 1.0x generate at 16, >= 2.0x at 64.
3. unsloth, then peft: LocalBackend(trainer=...) with the card's GPU preset; register (engine start and trainer
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
rollouts, rollouts at 4 and 8 parallel x 8 tokens (without `generate_batch`), a realistic batch of 8 x 64, and
the fsdp part with gloo ranks in fp32 on `artnb.models.tiny()` (8 x 64 tokens, 1 and 2 ranks sharing the CPU,
so no speed-up is expected; about 20 s on 2 cores); it also prints the presets the 1.5B model gets on every card
and which trainer "auto" picks here and why. MFU and GPU memory are n/a there.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
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
# The fsdp part (check_fsdp): its model, learning rate, tolerances and time limit.
FSDP_SIZE = "0.5B"
FSDP_LR = 1e-4
FSDP_MAX_DIFF_IN_LR = 0.1  # max |LoRA(FsdpTrainer) - LoRA(PeftTrainer)| after the step, in learning rates
FSDP_GRAD_NORM_RTOL = 1e-2  # |grad_norm(FsdpTrainer) / grad_norm(PeftTrainer) - 1|
FSDP_SPEEDUP_TARGET = 1.7  # 2 ranks against 1 (issue 30), on 2 GPUs
FSDP_BUDGET_S = 240  # the part stops itself after this (an nccl hang must not eat the other parts' time)


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
    decodings: dict = field(default_factory=dict)  # --worker rollouts: each engine decoding's own stats
    graphs_agree: bool | None = None  # --worker rollouts on CUDA: replayed graphs == eager slot steps
    fsdp: dict = field(default_factory=dict)  # --worker fsdp: the workload, a row per trainer, notes

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
    parser.add_argument("--worker", choices=["peft", "unsloth", "rollouts", "fsdp"], help=argparse.SUPPRESS)
    parser.add_argument("--part-s", type=int, default=1200, help="seconds each part may take on a GPU")
    parser.add_argument(
        "--only", help="comma-separated parts to run: fsdp,rollouts,unsloth,peft (all by default)"
    )
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
    parts = ["fsdp", "rollouts"]  # fsdp first: short, and reported even if a later part overruns CHECK_S
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
        elif part == "fsdp":
            print_fsdp(results[-1])
        elif len(parts) > 1:  # each part's rows as soon as it ends, in case a later one overruns
            print_table(results[-1:], dry_run=args.dry_run)
            print_batches(results[-1:])
    failed = bool(on_cuda and not args.dry_run and problem and "not installed" not in problem)
    ok = all(r.ok for r in results) and not failed
    trainers = [
        r for r in results if r.trainer not in ("rollouts", "fsdp") or (r.trainer == "rollouts" and not r.ok)
    ]
    if trainers:
        print_table(trainers, dry_run=args.dry_run)
        print_batches(trainers)
    for r in results:
        if r.error:
            print(f"{r.trainer} failed: {r.error}")
    if failed:
        print(f"unsloth is installed but cannot run: {problem}")
    return 0 if ok else 1


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
            limit = 600 if args.dry_run else args.part_s
            if trainer == "fsdp":  # it stops itself after FSDP_BUDGET_S; this is for a worker that cannot
                limit = min(limit, FSDP_BUDGET_S + 60)
            subprocess.run(command, timeout=limit, check=False)
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
        elif args.worker == "fsdp":
            check_fsdp(args, result)  # sets result.ok
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


def check_fsdp(args: argparse.Namespace, result: Result) -> None:
    """FsdpTrainer against PeftTrainer on the same GRPO step, checkpoints both ways, s/step at 1 and 2 ranks.

    Both start from the same checkpoint: PeftTrainer takes a warm-up step on another batch (so that lora_B is
    non-zero and AdamW has moments) and saves it; each trainer loads it, takes its own warm-up step (timing
    only), loads it again and then takes the compared step on the fixed batch, whose result it saves; two more
    steps on that batch give the median s/step. Both take the same TrainConfig (chunked logprobs included), and
    the sequences are of equal length, so at 1 rank both run the same micro-batches and any difference is
    FSDP's. Tolerances (FSDP_MAX_DIFF_IN_LR, FSDP_GRAD_NORM_RTOL): the
    base is bf16 on both sides but each row's forward is the same computation; what differs is the order of
    the fp32 sums of the LoRA gradients (2 ranks: which rows share a micro-batch, and the reduce-scatter). An
    AdamW step after the warm-up moves a weight by lr * |m^|/sqrt(v^) <= lr and amplifies gradient noise only
    where both steps' gradients of that weight vanish, so rounding stays far below 0.1 lr, while a lost or
    doubled rank share, a wrong shard or an optimizer step on stale shards moves many weights by a good part of
    lr (and shows in grad_norm, which AdamW's scale invariance would hide in the weights).

    Peak GPU memory per rank: a rank's own max_memory_allocated is not visible here, so each GPU's device-wide
    use (torch.cuda.mem_get_info) is sampled every 0.1 s while the trainer lives, less what was in use before
    it started: the rank's CUDA context and NCCL buffers included, short peaks possibly missed. The
    PeftTrainer's figure is measured the same way (its process's CUDA context excluded: it was made before)."""
    import signal

    import torch
    from distributed_scaling import batch  # this directory's: equal-length random sequences, half trainable

    from artnb import models
    from artnb.backends import gpu_presets
    from artnb.backends.trainers.fsdp_trainer import FsdpTrainer, RankFailed
    from artnb.backends.trainers.peft_trainer import PeftTrainer
    from artnb.core.config import LoRAConfig, TrainConfig, TrainerConfig

    def out_of_time(signum, frame):
        raise TimeoutError(f"the fsdp part ran past FSDP_BUDGET_S={FSDP_BUDGET_S} s")

    signal.signal(signal.SIGALRM, out_of_time)  # raised in the waiting loop of FsdpTrainer._call
    signal.alarm(FSDP_BUDGET_S)
    started = time.perf_counter()
    on_cuda = torch.cuda.is_available() and not args.dry_run
    card = gpu_presets.detect_card() if on_cuda else None
    result.card = card.name if card else torch.cuda.get_device_name(0) if on_cuda else "cpu"
    if on_cuda:  # the same micro-batch shapes at 1 and 2 ranks: 8 rows of 512 (CPU: 4 rows of 64)
        base = models.random_model(gpu_presets.QWEN2_5[FSDP_SIZE].config(), dtype="bfloat16")
        model_name = f"Qwen2.5-{FSDP_SIZE}-shaped random weights, bf16, nccl"
        count, length, micro = 64, 512, 4096
    else:
        base = models.tiny()
        model_name = "tiny Llama (artnb.models.tiny), fp32, gloo"
        count, length, micro = 8, 64, 256
    result.params = gpu_presets.model_shape(base).num_params()
    gpus = torch.cuda.device_count() if on_cuda else 0
    if on_cuda:
        torch.cuda.empty_cache()  # random_model may have built the model here: its cache would hide PeftTrainer's use
    lora, trainer_config = LoRAConfig(), TrainerConfig(device="auto" if on_cuda else "cpu")
    compare = {"learning_rate": FSDP_LR, "max_grad_norm": 100.0, "micro_batch_tokens": micro}  # no clipping
    peft_config = fsdp_config = TrainConfig(**compare)
    warm, fixed = batch(count, length, seed=1), batch(count, length, seed=2)
    result.fsdp = {
        "model": model_name,
        "workload": f"{count} x {length} tokens (half trainable), micro-batch {micro} tokens, lr {FSDP_LR:g}",
        "rows": [],
        "notes": [],
        "on_cuda": on_cuda,
    }
    rows = result.fsdp["rows"]

    def save_partial() -> None:  # what is done so far survives a timeout or a crash of this worker
        result.fsdp["seconds"] = time.perf_counter() - started
        Path(args.out).write_text(json.dumps(dataclasses.asdict(result)))

    def steps(trainer, config, save_to: Path) -> tuple[float, dict]:
        """The compared step (then saved to `save_to`) and two more on the fixed batch: (median s, its metrics)."""
        times, first = [], {}
        for i in range(3):
            begun = time.perf_counter()
            metrics = trainer.train(fixed, config, progress=False)
            if on_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - begun)
            if i == 0:
                first = metrics
                trainer.save_checkpoint(save_to)
        return statistics.median(times), first

    try:
        with tempfile.TemporaryDirectory(prefix="gpu-check-fsdp-") as tmp_dir:
            tmp = Path(tmp_dir)
            memory = [PeakMemory(0.1, device=0)] if on_cuda else []
            peft = PeftTrainer(base, lora, trainer_config)
            peft.train(warm, peft_config, progress=False)  # the warm-up step, from which both trainers start
            peft.save_checkpoint(tmp / "start")
            peft.load_checkpoint(tmp / "start")
            seconds, baseline = steps(peft, peft_config, tmp / "peft")
            rows.append(
                {
                    "trainer": "PeftTrainer (baseline)",
                    "ranks": "1 process",
                    "s": seconds,
                    "gib": _peaks(memory),
                }
            )
            save_partial()
            start = _adapter(tmp / "start")
            for ranks in (1, 2):
                if ranks > 1 and on_cuda and gpus < ranks:
                    result.fsdp["notes"].append(f"ranks={ranks}: needs {ranks} GPUs, this machine has {gpus}")
                    continue
                row: dict = {"trainer": "FsdpTrainer", "ranks": str(ranks)}
                rows.append(row)
                logs = tmp / f"logs-{ranks}"
                memory = [PeakMemory(0.1, device=i) for i in range(ranks)] if on_cuda else []
                fsdp = None
                try:
                    fsdp = FsdpTrainer(base, lora, trainer_config, ranks=ranks, log_dir=logs)
                    fsdp.load_checkpoint(tmp / "start")
                    fsdp.train(warm, fsdp_config)  # its warm-up step
                    fsdp.load_checkpoint(tmp / "start")
                    row["s"], metrics = steps(fsdp, fsdp_config, tmp / f"fsdp-{ranks}")
                    row["gib"] = _peaks(memory)
                    ours, theirs = _adapter(tmp / f"fsdp-{ranks}"), _adapter(tmp / "peft")
                    row["max_abs"] = max((ours[k] - theirs[k]).abs().max().item() for k in theirs)
                    moved = sum(((theirs[k] - start[k]) ** 2).sum().item() for k in theirs) ** 0.5
                    off = sum(((ours[k] - theirs[k]) ** 2).sum().item() for k in theirs) ** 0.5
                    row["update_rel"] = off / moved if moved else math.nan
                    row["grad_norm_rel"] = abs(metrics["grad_norm"] / baseline["grad_norm"] - 1)
                    row["same"] = (
                        row["max_abs"] <= FSDP_MAX_DIFF_IN_LR * FSDP_LR
                        and row["grad_norm_rel"] <= FSDP_GRAD_NORM_RTOL
                    )
                    # checkpoints both ways: PeftTrainer's -> FsdpTrainer -> saved, FsdpTrainer's -> PeftTrainer
                    fsdp.load_checkpoint(tmp / "peft")
                    fsdp.save_checkpoint(tmp / f"peft-via-fsdp-{ranks}")
                    peft.load_checkpoint(tmp / f"fsdp-{ranks}")
                    peft.save_checkpoint(tmp / f"fsdp-{ranks}-via-peft")
                    row["round_trip"] = max(
                        _checkpoint_diff(tmp / "peft", tmp / f"peft-via-fsdp-{ranks}"),
                        _checkpoint_diff(tmp / f"fsdp-{ranks}", tmp / f"fsdp-{ranks}-via-peft"),
                    )
                except RankFailed as error:  # its message has the rank's log tail
                    row["error"] = f"{type(error).__name__}: {error}"
                except Exception as error:
                    traceback.print_exc()
                    row["error"] = f"{type(error).__name__}: {error}" + _log_tails(logs)
                finally:
                    if fsdp is not None:
                        fsdp.close()
                    for m in memory:
                        m.stop()
                save_partial()
                if isinstance(row.get("error"), str) and row["error"].startswith("TimeoutError"):
                    break  # out of time: no next group
    finally:
        signal.alarm(0)
    failed = [r for r in rows[1:] if r.get("error") or not (r.get("same") and r.get("round_trip") == 0.0)]
    result.ok = len(rows) > 1 and not failed
    if failed:
        result.error = "; ".join(
            f"{r['ranks']} rank(s): {(r.get('error') or 'out of tolerance').splitlines()[0]}" for r in failed
        )
    save_partial()


def _adapter(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(path / "adapter_model.safetensors")


def _checkpoint_diff(a: Path, b: Path) -> float:
    """The largest difference between two checkpoints' tensors (adapter and AdamW state); inf if they do not
    match in names or shapes."""
    import torch

    first, second = _adapter(a), _adapter(b)
    if first.keys() != second.keys():
        return math.inf
    pairs = [(first[k].float(), second[k].float()) for k in first]
    opt_a = torch.load(a / "optimizer.pt", weights_only=True)["state"]
    opt_b = torch.load(b / "optimizer.pt", weights_only=True)["state"]
    if opt_a.keys() != opt_b.keys():
        return math.inf
    for index, entry in opt_a.items():
        if entry.keys() != opt_b[index].keys():
            return math.inf
        pairs += [(entry[k].float(), opt_b[index][k].float()) for k in entry]
    if any(x.shape != y.shape for x, y in pairs):
        return math.inf
    return max(((x - y).abs().max().item() for x, y in pairs if x.numel()), default=0.0)


def _peaks(memory: list) -> list[float]:
    """Each sampled GPU's peak use above what it had when sampling began, in GiB."""
    return [(m.stop() - m.start) / 2**30 for m in memory]


def _log_tails(logs: Path, lines: int = 20) -> str:
    tails = []
    for log in sorted(logs.glob("rank*.log")):
        text = log.read_text(errors="replace").splitlines()[-lines:]
        tails.append(f"\n--- {log.name} (last {lines} lines):\n" + ("\n".join(text) or "(empty)"))
    return "".join(tails)


# The HF engine's decodings the rollouts part compares, as HFEngine options.
DECODINGS = {
    "slots": {"decoding": "slots"},  # a CPU's default: nothing to capture
    "slots + graphs": {"decoding": "slots", "cuda_graphs": True},
    "slots, eager": {"decoding": "slots", "cuda_graphs": False},
    "dynamic": {"decoding": "dynamic"},
}


async def check_rollouts(args: argparse.Namespace, result: Result) -> None:
    """The HF engine through the OpenAI client, once per decoding (DECODINGS: three on CUDA, two on a CPU),
    against plain `generate` on the same prompts, 64 new tokens each (EOS masked until then), at 16 and 64
    parallel; transformers' own continuous batching (`generate_batch`) where it runs; and, on CUDA, replayed
    graphs against eager slot steps in this process (the same tokens and logprobs, bit for bit). Each engine
    alone on the card; then generate in this process."""
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
    rows: dict[int, dict] = {b: {"parallel": b, "tokens": tokens, "engine": {}} for b in batches}
    decodings = ["slots + graphs", "slots, eager", "dynamic"] if on_cuda else ["slots", "dynamic"]
    if on_cuda and importlib.util.find_spec("vllm") is not None:
        decodings.append("vLLM")  # alone on the card here; the trainer parts run it beside the trainer
    peaks = []
    for label in decodings:
        with tempfile.TemporaryDirectory(prefix="gpu-check-logs-") as logs:
            if label == "vLLM":
                from artnb.backends.engines.vllm.client import VLLMEngine

                engine = VLLMEngine(base, "check", logs)
            else:
                engine = HFEngine(
                    base, "check", logs, device="cuda" if on_cuda else "cpu", max_batch_size=max(batches),
                    **DECODINGS[label],
                )  # fmt: skip
            memory = PeakMemory() if on_cuda else None
            try:
                await engine.start()
                client = openai.AsyncOpenAI(base_url=engine.base_url, api_key=engine.api_key, max_retries=0)

                async def engine_run(batch: int, client=client) -> float:
                    async def one(messages) -> int:
                        completion = await client.chat.completions.create(
                            model="check", messages=messages, max_tokens=tokens, temperature=1.0,
                            extra_body={"min_tokens": tokens},
                        )  # fmt: skip
                        return completion.usage.completion_tokens

                    started = time.perf_counter()
                    counts = await asyncio.gather(*(one(m) for m in prompts[:batch]))
                    return sum(counts) / (time.perf_counter() - started)

                await engine_run(4)  # warm-up
                for batch in batches:
                    rows[batch]["engine"][label] = max([await engine_run(batch) for _ in range(2)])
                if isinstance(engine, HFEngine):
                    stats = await engine.stats()
                    keys = ("decoding", "cuda_graphs", "cuda_graphs_off_why", "graph_captures")
                    result.decodings[label] = {key: stats[key] for key in keys}
            except Exception as error:  # one engine's failure leaves the others' columns
                traceback.print_exc()
                result.error += f"{label}: {type(error).__name__}: {error}. "
                for batch in batches:
                    rows[batch]["engine"].setdefault(label, math.nan)
            finally:
                await engine.stop()
            if memory is not None:
                peaks.append(memory.stop() / 2**30)
    result.peak_gib = max(peaks, default=math.nan)
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
    if on_cuda:
        result.graphs_agree = graphs_agree(model, tokenizer, texts)
    result.ok = result.graphs_agree is not False and not result.error
    Path(args.out).write_text(json.dumps(dataclasses.asdict(result)))  # kept if the last part overruns
    for batch in batches if on_cuda else ():  # on a CPU it makes 2-4 tokens/s: minutes of CI for nothing
        rows[batch]["continuous"] = continuous_batching(model, tokenizer, texts[:batch], tokens, rows[batch])
    result.rollout_rows = list(rows.values())


def graphs_agree(model, tokenizer, texts: list[str]) -> bool:
    """Rows decoded from the slots with CUDA graphs replayed and with every step eager (the same buckets, so
    the same kernels): the same tokens and logprobs, bit for bit."""
    from artnb.backends.engines.hf.batching import Row, decode_batch
    from artnb.backends.engines.hf.slots import SlotDecoder

    ids = [tokenizer(t, add_special_tokens=False).input_ids for t in texts[:6]]
    runs = []
    for graphs in (False, True):
        slots = SlotDecoder(model, graphs=graphs)
        slots.begin(model, key="check")
        rows = [Row(p, max_tokens=8 + 4 * i, min_tokens=8 + 4 * i, seed=i) for i, p in enumerate(ids)]
        decode_batch(model, rows, pad_id=0, eos_ids=[-1], decode=lambda ids: "", slots=slots)
        slots.release()
        runs.append([(r.token_ids, r.logprobs) for r in rows])
    return runs[0] == runs[1]


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
    labels = list(result.rollout_rows[0]["engine"])
    print(
        "| parallel x new tokens | "
        + "".join(f"{label if label == 'vLLM' else 'HF engine, ' + label} | ratio | " for label in labels)
        + "model.generate | generate_batch (CB) | ratio |"
    )
    print("|---|" + "---|---|" * len(labels) + "---|---|---|")
    for r in result.rollout_rows:
        g = r["generate"]
        engines = "".join(
            f"{_num(r['engine'][label], 0)} | {_num(r['engine'][label] / g, 2)} | " for label in labels
        )
        print(
            f"| {r['parallel']} x {r['tokens']} | {engines}{g:.0f} | {_num(r['continuous'], 0)} | "
            f"{_num(r['continuous'] / g, 2)} |"
        )
        if "continuous_error" in r:
            print(f"  generate_batch: {r['continuous_error']}")
    for label, stats in result.decodings.items():
        graphs = f"; {stats['graph_captures']} graphs captured" if stats["cuda_graphs"] else ""
        off = f"; graphs off: {stats['cuda_graphs_off_why']}" if stats["cuda_graphs_off_why"] else ""
        print(f"  {label}: {stats['decoding']}{graphs}{off}")
    if result.graphs_agree is not None:
        print(f"replayed graphs against eager slot steps, bit for bit: {_yes(result.graphs_agree)}")
    print(f"engine processes' peak GPU memory (device-wide): {_num(result.peak_gib, 1, 'n/a')} GiB")


def print_fsdp(result: Result) -> None:
    f = result.fsdp
    if not f.get("rows"):
        print(f"fsdp: {result.error or 'no rows'}")
        return
    print(
        f"\nFSDP trainer against PeftTrainer on {result.card}: {f['model']}, {result.params / 1e9:.3g}B parameters; "
        f"{f['workload']}; s/step: median of 3 steps after a warm-up step; part took {f.get('seconds', 0):.0f} s"
    )
    print(
        "| trainer | ranks | s/step | speed vs PeftTrainer | speed-up vs 1 rank | grad_norm rel diff | "
        "max abs LoRA diff (in lr) | update rel diff | same step | checkpoints both ways | peak GPU GiB per rank |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = f["rows"]
    peft_s = rows[0].get("s", math.nan)
    one_rank = next((r.get("s", math.nan) for r in rows if r["ranks"] == "1"), math.nan)
    for r in rows:
        s = r.get("s", math.nan)
        fsdp = r["trainer"].startswith("FsdpTrainer")
        diff = r.get("max_abs", math.nan)
        trip = r.get("round_trip")
        gib = " / ".join(f"{g:.2f}" for g in r.get("gib", [])) or "n/a"
        print(
            f"| {r['trainer']} | {r['ranks']} | {_num(s, 3)} | {_ratio(peft_s, s)} | "
            f"{_ratio(one_rank, s) if fsdp else '-'} | "
            f"{_sci(r.get('grad_norm_rel')) if fsdp else '-'} | "
            f"{(_sci(diff) + f' ({diff / FSDP_LR:.3f})') if fsdp and math.isfinite(diff) else '-'} | "
            f"{_sci(r.get('update_rel')) if fsdp else '-'} | "
            f"{('ok' if r.get('same') else 'FAILED') if fsdp else '-'} | "
            f"{_trip(trip) if fsdp else '-'} | {gib} |"
        )
    print(
        f"same step: max abs LoRA diff <= {FSDP_MAX_DIFF_IN_LR:g} lr and grad_norm rel diff <= {FSDP_GRAD_NORM_RTOL:g} "
        "(why: check_fsdp's docstring); checkpoints both ways: the same tensors bit for bit (adapter and AdamW state)"
    )
    two = next((r for r in rows if r["ranks"] == "2" and "s" in r), None)
    if not f.get("on_cuda"):
        print("(CPU: the ranks share its cores, so the speed-up shows the cost of sharding, not a speed-up)")
    elif two is not None:
        speedup = one_rank / two["s"]
        met = "met" if speedup >= FSDP_SPEEDUP_TARGET else "NOT met"
        print(f"target (issue 30): 2 ranks >= {FSDP_SPEEDUP_TARGET}x 1 rank: {met} ({speedup:.2f}x)")
    for note in f.get("notes", []):
        print(note)
    for r in rows:
        if r.get("error"):
            print(f"FsdpTrainer, {r['ranks']} rank(s) failed: {r['error']}")


def _ratio(baseline: float, seconds: float) -> str:
    """How many times faster than the baseline: its seconds over these."""
    return f"{baseline / seconds:.2f}x" if math.isfinite(baseline / seconds) else "-"


def _sci(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.2e}"


def _trip(diff: float | None) -> str:
    if diff is None:
        return "-"
    return "exact" if diff == 0.0 else f"FAILED (max diff {diff:.2e})"


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
    """Device-wide GPU memory in use (every process: trainer and engine), its peak sampled in a thread; on the
    current device, or on `device`. `start` is the use when sampling began."""

    def __init__(self, interval_s: float = 0.2, device: int | None = None) -> None:
        import torch

        self._torch, self.peak, self._stop, self._device = torch, 0, threading.Event(), device
        free, total = torch.cuda.mem_get_info(device)
        self.start = total - free
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.is_set():
            free, total = self._torch.cuda.mem_get_info(self._device)
            self.peak = max(self.peak, total - free)
            self._stop.wait(interval_s)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


if __name__ == "__main__":
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    sys.exit(main())
