"""Is the HF engine's dynamic batching as fast as one `model.generate` call?

N chat requests sent in parallel through the OpenAI client to the HF engine against one `generate` call on
the same N prompts, both sampling 64 tokens at temperature 1 (EOS masked until then, so both do the same
work). Runs are interleaved and the best of `--repeats` is kept, because a shared CPU makes single runs noisy.
The engine always runs with OpenMP's PASSIVE wait policy (HFEngine's default: its threads sleep between
parallel regions, so a trainer or notebook beside it keeps the cores). `--generate-omp` picks `generate`'s:
- `same` (default): PASSIVE too, set before torch loads libgomp, so the ratio measures the serving code alone.
- `libgomp`: this process's own setting (libgomp spins a while before sleeping), so the ratio is what a
  user sees against a hand-written `generate`: PASSIVE costs a wake-up per parallel region. On this 2-core
  CPU that was 0.83x at 8 on the embedded model, against 1.10x under `same` (measured 2026-11-27; README).
  ACTIVE for both makes each process spin while the other computes: meaningful only with spare cores.

- `--model embedded` (default; batches 8 and 1): the embedded SmolLM2-135M. Target: the engine >= 0.9x
  `generate` at 8: HTTP, scheduling, sampling and logprobs all fit in the other 10%.
- `--model tiny` (batches 64 and 8): `artnb.models.tiny()`, 2 layers of width 64, whose compute is negligible,
  so tokens/s measure the serving code itself: HTTP, scheduling, the sampler, host copies. Target (issue 25):
  >= 0.95x `generate` at 64 parallel.
- `--decodings` (default both): one engine per decoding, side by side, runs interleaved: `slots` (the default:
  fixed per-row buffers, hf/slots.py) and `dynamic` (a growing cache, every model's fallback).
- `--history WORDS`: an earlier conversation of about that many words before each request, as an agent's later
  turns have: the dynamic cache copies all of it at every step, the slots do not.

    python benchmarks/engine_batching.py [--model embedded|tiny] [--batches 8,1] [--repeats 3] [--tokens 64]
        [--generate-omp same|libgomp] [--decodings slots,dynamic] [--history 0]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--model", choices=["embedded", "tiny"], default="embedded")
    parser.add_argument("--batches", help="parallel requests, comma-separated (embedded: 8,1; tiny: 64,8)")
    parser.add_argument("--generate-omp", choices=["same", "libgomp"], default="same")
    parser.add_argument("--decodings", default="slots,dynamic", help="HF engine decodings, comma-separated")
    parser.add_argument("--history", type=int, default=0, help="words of earlier conversation per request")
    return parser.parse_args()


ARGS = parse_args()
if ARGS.generate_omp == "same":
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # before torch loads libgomp, which reads it once

import openai  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # runs from a checkout without `pip install -e .`
from _throughput import engine_tokens_per_s, generate_tokens_per_s  # noqa: E402

from artnb.backends.engines.hf.client import HFEngine  # noqa: E402
from artnb.models import embedded_model_path, tiny  # noqa: E402

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
    """`batch` different prompts of similar length (the topics, then numbered), after `--history` words of an
    earlier exchange."""
    earlier = []
    if ARGS.history:
        story = " ".join(TOPICS[i % len(TOPICS)].split()[-1] for i in range(ARGS.history))
        earlier = [
            {"role": "user", "content": "Tell me a long story."},
            {"role": "assistant", "content": story},
        ]
    return [
        [
            *earlier,
            {
                "role": "user",
                "content": f"Write a short story about {TOPICS[i % len(TOPICS)]}, part {i // 8 + 1}.",
            },
        ]
        for i in range(batch)
    ]


async def main() -> None:
    args = ARGS
    batches = [int(b) for b in (args.batches or ("8,1" if args.model == "embedded" else "64,8")).split(",")]
    load_before = os.getloadavg()[0]
    path = str(embedded_model_path()) if args.model == "embedded" else tiny()
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    decodings = args.decodings.split(",")
    engines = {
        decoding: HFEngine(
            path,
            "smol",
            tempfile.mkdtemp(prefix="artnb-bench-"),
            device="cpu",
            max_batch_size=max(batches),
            omp_wait_policy="passive",
            decoding=decoding,
        )
        for decoding in decodings
    }
    try:
        await asyncio.gather(*(engine.start() for engine in engines.values()))
        clients = {
            decoding: openai.AsyncOpenAI(base_url=engine.base_url, api_key=engine.api_key)
            for decoding, engine in engines.items()
        }
        for client in clients.values():  # warm-up: first forward passes are slower
            await engine_tokens_per_s(client, "smol", conversations(8), 4)
        generate_tokens_per_s(model, tokenizer, conversations(8), 4)
        best: dict[tuple[str, int], float] = {}
        for _ in range(args.repeats):
            for batch in batches:
                chats = conversations(batch)
                runs = {("generate", batch): generate_tokens_per_s(model, tokenizer, chats, args.tokens)}
                for decoding, client in clients.items():
                    runs[(decoding, batch)] = await engine_tokens_per_s(client, "smol", chats, args.tokens)
                for key, value in runs.items():
                    best[key] = max(best.get(key, 0.0), value)
        said = {d: (await engines[d].stats())["decoding"] for d in decodings}
    finally:
        await asyncio.gather(*(engine.stop() for engine in engines.values()))
    print(
        f"\nmodel {args.model}: {args.tokens} new tokens per request, temperature 1, best of {args.repeats}, "
        f"torch threads {torch.get_num_threads()}, engine OMP_WAIT_POLICY=PASSIVE, "
        f"generate's {os.environ.get('OMP_WAIT_POLICY', 'unset (libgomp spins, then sleeps)')}"
    )
    print(
        f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after (other processes skew results)"
    )
    text = tokenizer.apply_chat_template(conversations(1)[0], tokenize=False, add_generation_prompt=True)
    prompt = len(tokenizer(text, add_special_tokens=False).input_ids)
    print(f"prompts of about {prompt} tokens; " + "; ".join(f"{d} engine: {said[d]}" for d in decodings))
    print(f"{'method':<52} {'tokens/s':>9} {'ratio':>7}")
    for batch in batches:
        baseline = best[("generate", batch)]
        rows = [(f"model.generate, batch {batch}", baseline)]
        requests = f"{batch} parallel OpenAI request{'s' * (batch > 1)}"
        rows += [(f"HF engine ({d}), {requests}", best[(d, batch)]) for d in decodings]
        for name, value in rows:
            print(f"{name:<52} {value:>9.1f} {value / baseline:>7.2f}")


if __name__ == "__main__":
    asyncio.run(main())
