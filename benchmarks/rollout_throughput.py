"""Rollout throughput: the vLLM engine and the HF engine against plain `model.generate` at the same batch.

1, 8 and 32 chat requests sent in parallel through the OpenAI client, each sampling exactly 64 tokens
(temperature 1, `min_tokens` = `max_tokens`, so every method does the same work), on the embedded
SmolLM2-135M in fp32; the baseline is one `generate` call on the same prompts (`min_new_tokens` =
`max_new_tokens`). Each is measured on the base model and with a LoRA adapter (r=8, all linear layers, as
PeftTrainer writes them) loaded as the newest step `agent@1` and requested as `agent`; `generate` then runs the
unmerged PeftModel. Each engine runs twice: serving the newest adapter merged into the weights (the default on
a CPU; the base model is then the LoRA that subtracts it) and as plain LoRA (`merge_newest=False`). Targets on a
2-core CPU with the adapter: vLLM >= 1.5x and the HF engine >= 0.9x the baseline at 8 and 32 parallel requests.
Runs are interleaved and the best of `--repeats` is kept, because a shared CPU makes single runs noisy.

    python benchmarks/rollout_throughput.py [--repeats 2] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

import openai
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # runs from a checkout without `pip install -e .`
from _throughput import engine_tokens_per_s, generate_tokens_per_s  # noqa: E402

from artnb.backends.engines.hf.client import HFEngine  # noqa: E402
from artnb.backends.engines.vllm.client import VLLMEngine, vllm_import_error  # noqa: E402
from artnb.models import embedded_model_path  # noqa: E402

BATCHES = (1, 8, 32)
SUBJECTS = [
    "a cat",
    "the sea",
    "a robot",
    "an old ship",
    "a tall tree",
    "a river",
    "a lazy king",
    "a small bird",
]
FORMS = ["a short story", "a poem", "a letter", "a song"]


def conversations(batch: int) -> list[list[dict[str, str]]]:
    prompts = [f"Write {form} about {subject}." for form in FORMS for subject in SUBJECTS]
    return [[{"role": "user", "content": prompt}] for prompt in prompts[:batch]]


def make_adapter(path: str, directory: Path) -> Path:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    get_peft_model(AutoModelForCausalLM.from_pretrained(path), config).save_pretrained(directory)
    return directory


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    if (problem := vllm_import_error()) is not None:
        print(f"rollout_throughput: skipped, the vLLM engine needs vLLM: {problem}")
        return
    path = str(embedded_model_path())
    scratch = Path(tempfile.mkdtemp(prefix="artnb-bench-"))
    adapter = make_adapter(path, scratch / "adapter")
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    from peft import PeftModel

    tuned = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), adapter
    ).eval()
    engines = {
        "vLLM, merged": VLLMEngine(path, "smol", scratch, merge_newest=True),
        "vLLM, LoRA": VLLMEngine(path, "smol", scratch, merge_newest=False),
        "HF, merged": HFEngine(path, "smol", scratch, device="cpu", merge_newest=True),
        "HF, LoRA": HFEngine(path, "smol", scratch, device="cpu", merge_newest=False),
    }
    best: dict[tuple[str, bool, int], float] = {}
    try:
        for engine in engines.values():
            await engine.start()
            await engine.load_adapter("agent@1", str(adapter))
        clients = {
            name: openai.AsyncOpenAI(base_url=e.base_url, api_key=e.api_key, max_retries=0, timeout=600)
            for name, e in engines.items()
        }
        for client in clients.values():  # warm-up: first forward passes are slower
            for model in ("smol", "agent"):
                await engine_tokens_per_s(client, model, conversations(8), 4)
        for model in (base, tuned):
            generate_tokens_per_s(model, tokenizer, conversations(8), 4)
        for _ in range(args.repeats):
            for batch in BATCHES:
                for lora in (False, True):
                    runs = {
                        "model.generate": generate_tokens_per_s(
                            tuned if lora else base, tokenizer, conversations(batch), args.tokens
                        )
                    }
                    for name, client in clients.items():
                        runs[name] = await engine_tokens_per_s(
                            client, "agent" if lora else "smol", conversations(batch), args.tokens
                        )
                    for name, value in runs.items():
                        best[name, lora, batch] = max(best.get((name, lora, batch), 0.0), value)
                    print(
                        f"parallel {batch}, LoRA {lora}: "
                        + ", ".join(f"{k} {v:.1f}" for k, v in runs.items())
                    )
    finally:
        for engine in engines.values():
            await engine.stop()
    print(
        f"\n{args.tokens} new tokens per request, temperature 1, best of {args.repeats}, {torch.get_num_threads()} threads"
    )
    print(
        f"{'method':<16} {'parallel':>8} {'base tok/s':>11} {'ratio':>6} {'adapter tok/s':>13} {'ratio':>6}"
    )
    for batch in BATCHES:
        for name in ("model.generate", *engines):
            cells = []
            for lora in (False, True):
                value = best[name, lora, batch]
                width = 13 if lora else 11
                cells.append(f"{value:>{width}.1f} {value / best['model.generate', lora, batch]:>6.2f}")
            print(f"{name:<16} {batch:>8} {' '.join(cells)}")


if __name__ == "__main__":
    asyncio.run(main())
