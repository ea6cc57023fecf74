"""Is decoding from slot buffers faster than from a growing cache? The HF engine's decoding loop alone.

`decode_batch` (hf/batching.py) on the same rows, from the engine's slot buffers (hf/slots.py, the default)
and from a `DynamicCache` (the baseline: what every model the slots do not fit decodes from), with no server,
HTTP or scheduler around it, so the ratio is the decoding's own. Two workloads:
- `turns`: 16 rows with prompts of 150-400 tokens and 6 new tokens each, like a game's move requests, where a
  step's cost is mostly attention over the prompt (and the dynamic cache copies it all at every step);
- `answers`: 16 rows with short prompts and 64 new tokens each.
Every row samples at temperature 1 with EOS masked until its last token (both sides do the same work), seeded,
so both decodings sample the same tokens. Runs alternate between the two and the best of `--repeats` is kept
(a shared CPU makes single runs noisy). The slot decoder is one for all runs, as in an engine, where the
buffers stay between batches.

    python benchmarks/slot_decoding.py [--model embedded|tiny] [--repeats 3] [--rows 16]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # runs from a checkout without `pip install -e .`
from artnb.backends.engines.hf.batching import Row, check_slots, decode_batch  # noqa: E402
from artnb.backends.engines.hf.slots import SlotDecoder  # noqa: E402
from artnb.models import embedded_model_path, tiny  # noqa: E402

WORKLOADS = {  # name: (prompt tokens of the first and last row, new tokens per row)
    "turns": ((150, 400), 6),
    "answers": ((20, 40), 64),
}


def rows(tokenizer, workload: str, count: int) -> list[Row]:
    (shortest, longest), new = WORKLOADS[workload]
    words = tokenizer("the board shows a cross in the corner and a circle beside it, your move").input_ids
    out = []
    for i in range(count):
        length = shortest + (longest - shortest) * i // max(1, count - 1)
        prompt = (words * (length // len(words) + 1))[:length]
        out.append(Row(prompt, max_tokens=new, min_tokens=new, seed=i))
    return out


def timed(model, tokenizer, batch: list[Row], slots: SlotDecoder | None) -> float:
    if slots is not None:
        slots.begin(model, key="base")
    start = time.perf_counter()
    decode_batch(
        model, batch, pad_id=0, eos_ids=[tokenizer.eos_token_id], decode=tokenizer.decode, slots=slots
    )
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["embedded", "tiny"], default="embedded")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=16)
    args = parser.parse_args()
    path = str(embedded_model_path()) if args.model == "embedded" else tiny()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    slots = SlotDecoder(model)
    check = check_slots(model, slots, pad_id=0, eos_ids=[tokenizer.eos_token_id])
    if check.problem is not None:
        raise SystemExit(f"this model does not decode from slots: {check.problem}")
    load_before = os.getloadavg()[0]
    for workload in WORKLOADS:  # warm-up: the first passes allocate and are slower
        timed(model, tokenizer, rows(tokenizer, workload, args.rows), slots)
        timed(model, tokenizer, rows(tokenizer, workload, args.rows), None)
    best: dict[tuple[str, str], float] = {}
    same = True
    for _ in range(args.repeats):
        for workload in WORKLOADS:
            sampled = {}
            for name, decoder in (("dynamic", None), ("slots", slots)):
                batch = rows(tokenizer, workload, args.rows)
                seconds = timed(model, tokenizer, batch, decoder)
                best[(workload, name)] = min(best.get((workload, name), float("inf")), seconds)
                sampled[name] = [r.token_ids for r in batch]
            same = same and sampled["dynamic"] == sampled["slots"]
    agreed = "yes" if same else "no (a float-rounding flip, or a fault: tests/backends/test_hf_slots.py)"
    print(
        f"\nmodel {args.model}, {args.rows} rows, torch threads {torch.get_num_threads()}, best of "
        f"{args.repeats}; load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after; start check: "
        f"logprobs within {check.difference:.2g}; same tokens both ways: {agreed}"
    )
    print(f"{'workload':<44} {'dynamic s':>10} {'slots s':>9} {'speed-up':>9}")
    for workload, ((shortest, longest), new) in WORKLOADS.items():
        dynamic, slotted = best[(workload, "dynamic")], best[(workload, "slots")]
        name = f"{workload}: prompts {shortest}-{longest} tokens, {new} new"
        print(f"{name:<44} {dynamic:>10.2f} {slotted:>9.2f} {dynamic / slotted:>8.2f}x")


if __name__ == "__main__":
    main()
