"""Does one long prompt among short ones slow the HF engine's whole batch?

A multi-turn agent's conversation grows with every tool call, so a batch of rollouts mixes short prompts with
long ones. The HF engine prefills the rows that join a batch in chunks of similar prompt lengths
(`engines/hf/batching.py`, `prefill_chunks`); the baseline is one padded pass over all of them, what it did
before, whose attention costs rows x longest^2. Both prefill the same rows of the embedded model in this
process, interleaved, best of `--repeats`; the ratio is baseline / chunks (above 1: the chunks are faster).

    python benchmarks/engine_prefill.py [--short 15] [--long-tokens 1000] [--repeats 2]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from artnb import models
from artnb.backends.engines.hf.batching import Row, _Batch, prefill_chunks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--short", type=int, default=15, help="short prompts beside the long one")
    parser.add_argument("--long-tokens", type=int, default=1000, help="about how long the long prompt is")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    path = str(models.embedded_model_path())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    long_prompt = tokenizer(
        "The game so far: " + "move left, then right. " * (args.long_tokens // 6)
    ).input_ids
    short = [tokenizer(f"Say hi to player {i} now").input_ids for i in range(args.short)]

    def rows() -> list[Row]:
        return [Row(prompt_ids=p, max_tokens=8) for p in [*short, long_prompt]]

    best = {"one padded pass (before)": float("inf"), "length chunks (now)": float("inf")}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for label, prefill in zip(best, ("_add", "add"), strict=True):
                batch = _Batch(model, pad_id=tokenizer.pad_token_id or 0, eos_ids=[tokenizer.eos_token_id])
                start = time.perf_counter()
                getattr(batch, prefill)(rows())
                best[label] = min(best[label], time.perf_counter() - start)

    chunks = [len(c) for c in prefill_chunks(rows())]
    print(
        f"{args.short} prompts of ~{len(short[0])} tokens + 1 of {len(long_prompt)}; chunks (rows): {chunks}"
    )
    print(f"| prefill | seconds (best of {args.repeats}) | ratio vs one padded pass |")
    print("|---|---|---|")
    baseline = best["one padded pass (before)"]
    for label, seconds in best.items():
        print(f"| {label} | {seconds:.2f} | {baseline / seconds:.1f}x |")


if __name__ == "__main__":
    main()
