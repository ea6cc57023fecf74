"""`benchmarks/gpu_check.py` as CI runs it: `--dry-run` does the CPU-capable parts end to end (a tiny Qwen2 model
built locally, preset choice, the trainer "auto" picks and why, one PEFT step over the HF engine, hot-load,
resume, the FSDP trainer's ranks against PeftTrainer) and prints its tables; without --dry-run a machine without
CUDA is told what to run instead."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def test_dry_run_passes_and_prints_its_table():
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=900, env=ENV
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    out = run.stdout
    assert "trainer='auto' uses PEFT: this machine has no CUDA GPU, which Unsloth needs" in out
    for card in ("T4", "L4", "A100-40GB", "A100-80GB", "H100-80GB"):
        assert any(line.strip().startswith(card + " ") for line in out.splitlines()), card
    assert "T4         16-bit trainer" in out and "float16, eager" in out  # T4: no bf16, no CUDA graphs
    header = next(line for line in out.splitlines() if line.startswith("| trainer | engine |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    row = next(line for line in out.splitlines() if line.startswith("| peft |"))
    cells = dict(zip(columns, (c.strip() for c in row.strip("|").split("|")), strict=True))
    assert cells["engine"] == "HFEngine"
    assert float(cells["register s"]) > 0 and float(cells["rollout tok/s"]) > 0
    assert float(cells["s/step (first, rest)"].split(",")[0]) > 0 and float(cells["trainer tok/s"]) > 0
    assert (cells["MFU"], cells["peak GPU GiB"]) == ("n/a", "n/a")  # no GPU to measure against
    assert (cells["hot-load"], cells["resume"]) == ("ok", "ok")
    rollouts = next(line for line in out.splitlines() if line.startswith("| 8 x 8 |")).strip("|").split("|")
    slots, slots_ratio, dynamic, dynamic_ratio, generate = (float(c) for c in rollouts[1:6])
    assert generate > 0 and abs(slots_ratio - slots / generate) < 0.02
    assert abs(dynamic_ratio - dynamic / generate) < 0.02
    assert "  slots: slots (start check: logprobs within" in out and "  dynamic: dynamic, as asked" in out
    batch = (
        next(line for line in out.splitlines() if line.startswith("| peft | 8 x 64 |")).strip("|").split("|")
    )
    assert float(batch[4]) > 0 and float(batch[5]) > 0  # s/step, tok/s of the realistic batch
    # the fsdp part: gloo ranks against PeftTrainer on the same step, checkpoints both ways
    for ranks in ("1", "2"):
        fsdp = next(line for line in out.splitlines() if line.startswith(f"| FsdpTrainer | {ranks} |"))
        cells = [c.strip() for c in fsdp.strip("|").split("|")]
        assert float(cells[2]) > 0 and cells[8:10] == ["ok", "exact"], fsdp


def test_without_cuda_a_real_run_says_to_use_dry_run():
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300, env=ENV)
    assert run.returncode == 2
    assert "no CUDA GPU here" in run.stdout and "--dry-run" in run.stdout
