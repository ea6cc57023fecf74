"""Is the HF engine's dynamic batching as fast as one `model.generate` call?

Eight chat requests sent in parallel through the OpenAI client to the HF engine (running the embedded
SmolLM2-135M) against one `generate` call on the same eight prompts, both sampling 64 tokens at temperature 1
(EOS masked until then, so both do the same work); the same for a single request. The engine must reach 90%
of `generate` at batch 8: HTTP, scheduling, per-row sampling and logprobs all fit in the other 10%.
Runs are interleaved and the best of `--repeats` is kept, because a shared CPU makes single runs noisy.
The engine runs with OMP_WAIT_POLICY=PASSIVE (HFEngine's default), `generate` with this process's setting.

    python benchmarks/engine_batching.py [--repeats 3] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import openai
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # runs from a checkout without `pip install -e .`
from artnb.backends.engines.process import HFEngine  # noqa: E402
from artnb.models import embedded_model_path  # noqa: E402

TOPICS = [
    "a cat",
    "the sea",
    "a robot",
    "an old ship",
    "a tall tree",
    "a river",
    "a lazy king",
    "a small bird",
]


def conversations(batch: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"Write a short story about {topic}."}] for topic in TOPICS[:batch]]


def generate_tokens_per_s(model, tokenizer, batch: int, tokens: int) -> float:
    texts = [
        tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
        for c in conversations(batch)
    ]
    inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            **inputs,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
        )
    elapsed = time.perf_counter() - start
    assert out.shape[1] - inputs["input_ids"].shape[1] == tokens
    return batch * tokens / elapsed


async def engine_tokens_per_s(client: openai.AsyncOpenAI, batch: int, tokens: int) -> float:
    async def one(messages):
        completion = await client.chat.completions.create(
            model="smol",
            messages=messages,
            temperature=1.0,
            max_tokens=tokens,
            extra_body={"min_tokens": tokens},
        )
        return completion.usage.completion_tokens

    start = time.perf_counter()
    counts = await asyncio.gather(*[one(c) for c in conversations(batch)])
    elapsed = time.perf_counter() - start
    assert counts == [tokens] * batch, counts
    return sum(counts) / elapsed


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    path = str(embedded_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = HFEngine(path, "smol", tempfile.mkdtemp(prefix="artnb-bench-"), device="cpu")
    await engine.start()
    client = openai.AsyncOpenAI(base_url=engine.base_url, api_key=engine.api_key)
    try:
        await engine_tokens_per_s(client, 8, 4)  # warm-up: first forward passes are slower
        generate_tokens_per_s(model, tokenizer, 8, 4)
        best: dict[tuple[str, int], float] = {}
        for _ in range(args.repeats):
            for batch in (8, 1):
                runs = {
                    ("generate", batch): generate_tokens_per_s(model, tokenizer, batch, args.tokens),
                    ("engine", batch): await engine_tokens_per_s(client, batch, args.tokens),
                }
                for key, value in runs.items():
                    best[key] = max(best.get(key, 0.0), value)
    finally:
        await engine.stop()
    print(
        f"\n{args.tokens} new tokens per request, temperature 1, best of {args.repeats}, torch threads {torch.get_num_threads()}"
    )
    print(
        f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after (other processes skew results)"
    )
    print(f"{'method':<42} {'tokens/s':>9} {'ratio':>7}")
    for batch in (8, 1):
        baseline = best[("generate", batch)]
        rows = [
            (f"model.generate, batch {batch}", baseline),
            (f"HF engine, {batch} parallel OpenAI request{'s' * (batch > 1)}", best[("engine", batch)]),
        ]
        for name, value in rows:
            print(f"{name:<42} {value:>9.1f} {value / baseline:>7.2f}")


if __name__ == "__main__":
    asyncio.run(main())
