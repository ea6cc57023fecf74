"""Which OpenMP wait policy lets the HF engine decode fast on an idle CPU and still hold up on a busy one?

Torch's CPU wheel runs its threads on GNU libgomp. After each parallel region a worker thread spins
GOMP_SPINCOUNT iterations waiting for the next one, then sleeps: 300000 iterations (a few ms) when nothing
is set, forever with OMP_WAIT_POLICY=ACTIVE, not at all with PASSIVE. Decoding runs hundreds of small
parallel regions per token, so sleeping waiters pay a wake-up each time on an idle machine; spinning
waiters burn the time slices that the other thread needs when other processes keep the cores busy.

Each variant starts the HF engine (embedded SmolLM2-135M, fp32, a LoRA adapter served as RL samples it:
the newest, merged; one variant serves it unmerged, as the engine did before) with its OpenMP setting,
and 8 parallel chat requests sample a fixed number of tokens, first with the machine as it is ("idle"),
then with `--busy` busy-loop processes competing for the cores.
The baseline is `model.generate` with the same adapter (PEFT, unmerged; what rollout_throughput.py
compares with) in a child process with no OpenMP setting, as a notebook runs it. All engines stay up and
take turns (short runs, round after round, in rotating order), and the best of `--repeats` is kept, because
a shared CPU makes single runs noisy; the range is printed too.
Run it on a quiet machine: the load average is printed before and after.

    python benchmarks/omp_wait_policy.py [--repeats 4] [--tokens 32] [--busy-tokens 8] [--variants ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # runs from a checkout without `pip install -e .`
from artnb.backends.engines.hf.client import AUTO_OMP_ENV, OMP_ENV_KEYS, HFEngine  # noqa: E402
from artnb.models import embedded_model_path  # noqa: E402

BATCH = 8
# name -> (HFEngine's omp_wait_policy, environment set before start ("auto" defers to it), merge_newest)
VARIANTS: dict[str, tuple[str, dict[str, str], bool]] = {
    "passive, LoRA unmerged": ("passive", {}, False),  # the engine before merged serving
    "passive": ("passive", {}, True),
    "unset (spin 300k)": ("auto", {"GOMP_SPINCOUNT": "300000"}, True),  # libgomp's default
    "active": ("active", {}, True),
    "spin 1k": ("auto", {"GOMP_SPINCOUNT": "1000"}, True),
    "spin 10k": ("auto", {"GOMP_SPINCOUNT": "10000"}, True),
    "spin 30k": ("auto", {"GOMP_SPINCOUNT": "30000"}, True),
    "spin 100k": ("auto", {"GOMP_SPINCOUNT": "100000"}, True),
    "auto": ("auto", {}, True),
}
PROMPTS = [
    f"Write a short story about {topic}."
    for topic in ["a cat", "the sea", "a robot", "an old ship", "a tall tree", "a river", "a king", "a bird"]
]


def make_adapter(path: str, directory: Path) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    get_peft_model(AutoModelForCausalLM.from_pretrained(path), config).save_pretrained(directory)
    return directory


def generate_worker(model_path: str, adapter: str) -> None:
    """Child process: read token counts from stdin, answer each with one `generate` call's tokens/s."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, adapter).eval()
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in PROMPTS[:BATCH]
    ]
    inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    for line in sys.stdin:
        tokens = int(line)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(**inputs, do_sample=True, top_k=0, max_new_tokens=tokens, min_new_tokens=tokens)
        print(json.dumps(BATCH * tokens / (time.perf_counter() - start)), flush=True)


class Generate:
    """The baseline in a child process with no OpenMP setting."""

    def __init__(self, model_path: str, adapter: Path):
        env = {k: v for k, v in os.environ.items() if k not in OMP_ENV_KEYS}
        command = [sys.executable, __file__, "--generate-worker", model_path, str(adapter)]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
        )

    def tokens_per_s(self, tokens: int) -> float:
        self.process.stdin.write(f"{tokens}\n")
        self.process.stdin.flush()
        return float(self.process.stdout.readline())

    def stop(self) -> None:
        self.process.stdin.close()
        self.process.wait()


async def engine_tokens_per_s(client: openai.AsyncOpenAI, tokens: int) -> float:
    async def one(prompt: str) -> int:
        completion = await client.chat.completions.create(
            model="agent",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=tokens,
            extra_body={"min_tokens": tokens},
        )
        return completion.usage.completion_tokens

    start = time.perf_counter()
    counts = await asyncio.gather(*[one(p) for p in PROMPTS[:BATCH]])
    assert counts == [tokens] * BATCH, counts
    return sum(counts) / (time.perf_counter() - start)


BUSY_LOOP = """
import os
parent = os.getppid()
while os.getppid() == parent:  # a killed benchmark leaves no spinning process behind
    for _ in range(1_000_000):
        pass
"""


def start_busy(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(count)]


def stop_busy(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.kill()
        process.wait()


class Variant:
    """One variant's engine. Idle engines stay up between turns (their threads sleep once they stop
    spinning), except an "active" one, whose threads spin forever: it runs only during its own turns."""

    def __init__(self, name: str, model_path: str, adapter: Path, logs: Path):
        self.name, self.model_path, self.adapter, self.logs = name, model_path, adapter, logs
        self.policy, self.environment, self.merge = VARIANTS[name]
        self.engine: HFEngine | None = None

    async def start(self) -> None:
        if self.engine is not None:
            return
        saved = {key: os.environ.pop(key, None) for key in OMP_ENV_KEYS}
        os.environ.update(self.environment)
        engine = HFEngine(
            self.model_path,
            "smol",
            self.logs,
            device="cpu",
            omp_wait_policy=self.policy,
            merge_newest=self.merge,
        )
        try:
            await engine.start()
        finally:
            for key, value in saved.items():
                os.environ.pop(key, None)
                if value is not None:
                    os.environ[key] = value
        self.engine = engine
        await engine.load_adapter("agent@1", str(self.adapter))
        self.client = openai.AsyncOpenAI(base_url=engine.base_url, api_key=engine.api_key, max_retries=0)
        await engine_tokens_per_s(self.client, 4)  # warm-up: the first forward passes are slower
        merged = (await engine.stats())["merged"]
        assert merged == ("agent@1" if self.merge else None), f"merge_newest={self.merge}, but {merged=}"

    async def tokens_per_s(self, tokens: int) -> float:
        await self.start()
        result = await engine_tokens_per_s(self.client, tokens)
        if self.policy == "active":
            await self.stop()
        return result

    async def stop(self) -> None:
        if self.engine is not None:
            await self.engine.stop()
            self.engine = None


def spread(values: list[float]) -> str:
    return f"{min(values):.1f}-{max(values):.1f}" if len(values) > 1 else ""


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=4, help="rounds per condition; the best is kept")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per request, idle machine")
    parser.add_argument("--busy-tokens", type=int, default=8, help="tokens per request, busy machine")
    parser.add_argument("--busy", type=int, default=2, help="busy-loop processes for the busy measurement")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["passive, LoRA unmerged", "passive", "unset (spin 300k)", "spin 10k", "auto"],
        choices=list(VARIANTS),
    )
    args = parser.parse_args()
    load_before = os.getloadavg()
    path = str(embedded_model_path())
    scratch = Path(tempfile.mkdtemp(prefix="artnb-omp-"))
    adapter = make_adapter(path, scratch / "adapter")
    generate = Generate(path, adapter)
    variants = [Variant(name, path, adapter, scratch) for name in args.variants]
    runs: dict[tuple[str, str], list[float]] = {}
    try:
        generate.tokens_per_s(4)  # warm-up
        for variant in variants:
            if variant.policy != "active":
                await variant.start()
        for condition, tokens in (("idle", args.tokens), ("busy", args.busy_tokens)):
            busy = start_busy(args.busy) if condition == "busy" else []
            try:
                for repeat in range(args.repeats):
                    order = variants[repeat % len(variants) :] + variants[: repeat % len(variants)]
                    for variant in order:
                        runs.setdefault((variant.name, condition), []).append(
                            await variant.tokens_per_s(tokens)
                        )
                    runs.setdefault(("generate", condition), []).append(generate.tokens_per_s(tokens))
                    line = ", ".join(f"{n} {v[-1]:.1f}" for (n, c), v in runs.items() if c == condition)
                    print(f"{condition}, round {repeat + 1}: {line}", flush=True)
            finally:
                stop_busy(busy)
    finally:
        generate.stop()
        for variant in variants:
            await variant.stop()
    auto = ", ".join(f"{k}={v}" for k, v in AUTO_OMP_ENV.items())
    print(
        f"\n{BATCH} parallel requests, LoRA adapter, tok/s best of {args.repeats} (range); idle: {args.tokens} "
        f"tokens, busy: {args.busy_tokens} tokens with {args.busy} busy-loop processes; auto = {auto}"
    )
    print(
        f"load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after (other processes skew "
        f"results); {os.cpu_count()} CPUs"
    )
    baseline = {c: max(runs["generate", c]) for c in ("idle", "busy")}
    passive_busy = max(runs["passive", "busy"]) if ("passive", "busy") in runs else None
    print(
        f"{'variant':<24} {'idle tok/s':>10} {'range':>11} {'x generate':>10} "
        f"{'busy tok/s':>10} {'range':>11} {'x generate':>10} {'x passive':>9}"
    )
    for name in ["generate", *args.variants]:
        idle, busy = runs[name, "idle"], runs[name, "busy"]
        versus_passive = f"{max(busy) / passive_busy:>9.2f}" if passive_busy else f"{'':>9}"
        label = "model.generate + LoRA" if name == "generate" else name
        print(
            f"{label:<24} {max(idle):>10.1f} {spread(idle):>11} {max(idle) / baseline['idle']:>10.2f} "
            f"{max(busy):>10.1f} {spread(busy):>11} {max(busy) / baseline['busy']:>10.2f} {versus_passive}"
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--generate-worker"]:
        generate_worker(*sys.argv[2:4])
    else:
        asyncio.run(main())
