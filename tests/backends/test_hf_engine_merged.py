"""The HF engine serving each family's newest adapter merged into the base weights (merge_newest).

Precision tests run the embedded SmolLM2-135M in fp32 (a real model, where rounding differences show) and
compare first-token logprobs with PEFT in this process; option tests use the tiny model.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from artnb import models
from artnb.backends.engines.hf.client import AUTO_OMP_ENV, HFEngine, omp_environment

PROMPT = [{"role": "user", "content": "Name three colours."}]
TOP = 20  # first-token logprobs compared: the 20 most likely tokens'


def make_adapters(path: str, root: Path, count: int, **config) -> list[Path]:
    """`count` LoRA adapters with random (non-zero) weights, shaped as PeftTrainer writes them."""
    paths = []
    for seed in range(count):
        torch.manual_seed(seed)
        lora = LoraConfig(
            **{"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "init_lora_weights": False, **config}
        )
        get_peft_model(AutoModelForCausalLM.from_pretrained(path), lora).save_pretrained(root / f"a{seed}")
        paths.append(root / f"a{seed}")
    return paths


class Reference:
    """First-token logprobs of the base model and of each adapter, computed by PEFT (unmerged) in process."""

    def __init__(self, path: str, adapters: list[Path]):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.peft = PeftModel.from_pretrained(model, adapters[0], adapter_name="a0").eval()
        for i, adapter in enumerate(adapters[1:], start=1):
            self.peft.load_adapter(adapter, adapter_name=f"a{i}")

    @torch.inference_mode()
    def top(self, prompt_ids: list[int], adapter: str | None) -> torch.Tensor:
        ids = torch.tensor([prompt_ids])
        if adapter is None:
            with self.peft.disable_adapter():
                logits = self.peft(ids).logits[0, -1]
        else:
            self.peft.set_adapter(adapter)
            logits = self.peft(ids).logits[0, -1]
        return torch.log_softmax(logits.float(), -1).topk(TOP).values


async def first_token(client: openai.AsyncOpenAI, model: str) -> tuple[str, list[int], torch.Tensor]:
    """(served model, prompt token ids, the TOP largest first-token logprobs, sorted) for one greedy token.

    Sorted values, not (token, value) pairs: two near-equal tokens may swap places between two ways of
    computing the same distribution, and sorting moves no value by more than the largest difference.
    """
    completion = await client.chat.completions.create(
        model=model, messages=PROMPT, max_tokens=1, temperature=0, logprobs=True, top_logprobs=TOP
    )
    top = completion.choices[0].logprobs.content[0].top_logprobs
    values = torch.tensor(sorted((t.logprob for t in top), reverse=True))
    return completion.model, completion.prompt_token_ids, values


def close(a: torch.Tensor, b: torch.Tensor, atol: float) -> None:
    torch.testing.assert_close(a, b, atol=atol, rtol=0)


@pytest.fixture(scope="module")
def embedded() -> str:
    return str(models.embedded_model_path())


@pytest.fixture(scope="module")
def adapters(embedded, tmp_path_factory) -> list[Path]:
    return make_adapters(embedded, tmp_path_factory.mktemp("adapters"), 2)


@pytest.fixture(scope="module")
def reference(embedded, adapters) -> Reference:
    return Reference(embedded, adapters)


@pytest.fixture(scope="module")
async def engine(embedded, tmp_path_factory):
    engine = HFEngine(embedded, "base", tmp_path_factory.mktemp("logs"), device="cpu", max_loras=3)
    await engine.start(timeout=300)
    yield engine
    await engine.stop()


@pytest.fixture(scope="module")
def client(engine) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=engine.base_url, api_key=engine.api_key, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
async def base_before(engine, client, reference) -> torch.Tensor:
    """The base model's first-token logprobs before any adapter was loaded."""
    model, prompt, values = await first_token(client, "base")
    close(values, reference.top(prompt, None), 1e-4)
    assert (await engine.stats())["merged"] is None
    return values


async def test_merged_equals_lora(engine, client, reference, adapters, base_before):
    await engine.load_adapter("agent@1", str(adapters[0]))
    model, prompt, merged = await first_token(client, "agent")
    assert model == "agent@1" and (await engine.stats())["merged"] == "agent@1"
    assert (merged - base_before).abs().max() > 1e-2, "the adapter must change the logprobs"
    # The same directory as a newer step: agent@1 is now an older step, served as LoRA.
    await engine.load_adapter("agent@2", str(adapters[0]))
    model, _, lora = await first_token(client, "agent@1")
    assert model == "agent@1" and (await engine.stats())["merged"] is None
    close(merged, lora, 1e-4)
    close(lora, reference.top(prompt, "a0"), 1e-4)
    model, _, merged_again = await first_token(client, "agent@2")
    assert model == "agent@2" and (await engine.stats())["merged"] == "agent@2"
    close(merged_again, lora, 1e-4)


async def test_switching_leaves_base_and_older_steps_exact(engine, client, reference, adapters, base_before):
    """Base, newest (merged) and an older step (LoRA) alternate 20 times: each stays what it was."""
    await engine.load_adapter("agent@3", str(adapters[1]))
    stats = await engine.stats()
    assert stats["adapters"] == ["agent@1", "agent@2", "agent@3"]
    _, prompt, older = await first_token(client, "agent@1")
    newest_reference = reference.top(prompt, "a1")
    for _ in range(20):
        model, _, newest = await first_token(client, "agent")
        assert model == "agent@3" and (await engine.stats())["merged"] == "agent@3"
        close(newest, newest_reference, 1e-4)
        close((await first_token(client, "base"))[2], base_before, 1e-5)
        close((await first_token(client, "agent@1"))[2], older, 1e-5)
    assert (await engine.stats())["merge_passes"] == stats["merge_passes"], "a switch must not re-merge"


async def test_unload_and_eviction_unmerge_first(engine, client, reference, adapters, base_before):
    assert (await first_token(client, "agent"))[0] == "agent@3"
    await engine.unload_adapter("agent@3")  # the merged one
    assert (await engine.stats())["merged"] is None
    close((await first_token(client, "base"))[2], base_before, 1e-5)
    model, prompt, values = await first_token(client, "agent")  # now agent@2, merged on demand
    assert model == "agent@2" and (await engine.stats())["merged"] == "agent@2"
    close(values, reference.top(prompt, "a0"), 1e-4)

    await engine.unload_adapter("agent@2")
    await engine.load_adapter("other@1", str(adapters[1]))
    await engine.load_adapter("other@2", str(adapters[0]))
    model, _, values = await first_token(client, "agent")  # agent@1, the oldest loaded
    assert model == "agent@1" and (await engine.stats())["merged"] == "agent@1"
    await engine.load_adapter("other@3", str(adapters[1]))  # max_loras=3: evicts agent@1, the merged one
    stats = await engine.stats()
    assert stats["adapters"] == ["other@1", "other@2", "other@3"] and stats["merged"] is None
    close((await first_token(client, "base"))[2], base_before, 1e-5)
    model, _, values = await first_token(client, "other")
    assert model == "other@3" and (await engine.stats())["merged"] == "other@3"
    close(values, reference.top(prompt, "a1"), 1e-4)
    close((await first_token(client, "other@2"))[2], reference.top(prompt, "a0"), 1e-4)

    # Unloading the last adapter while it is merged: the plain model that remains has the base weights.
    await engine.unload_adapter("other@1")
    await engine.unload_adapter("other@2")
    assert (await first_token(client, "other"))[0] == "other@3"
    assert (await engine.stats())["merged"] == "other@3"
    await engine.unload_adapter("other@3")
    stats = await engine.stats()
    assert stats["adapters"] == [] and stats["merged"] is None
    close((await first_token(client, "base"))[2], base_before, 1e-5)


@pytest.fixture(scope="module")
def tiny() -> str:
    return models.tiny()


async def test_merge_newest_off_and_unmergeable_adapters_serve_lora(tiny, tmp_path, monkeypatch):
    """merge_newest=False never merges; with it on, an adapter that cannot merge (DoRA) is served as LoRA."""
    plain = make_adapters(tiny, tmp_path / "plain", 1)[0]
    dora = make_adapters(tiny, tmp_path / "dora", 1, use_dora=True)[0]
    reference = Reference(tiny, [plain, dora])
    monkeypatch.setenv("GOMP_SPINCOUNT", "1234")  # an explicit policy replaces the user's setting whole
    off = HFEngine(tiny, "base", tmp_path, device="cpu", merge_newest=False, omp_wait_policy="passive")
    on = HFEngine(tiny, "base", tmp_path, device="cpu")  # the default on CPU: merge
    async with off, on:
        environment = Path(f"/proc/{off.pid}/environ").read_bytes().split(b"\0")
        assert b"OMP_WAIT_POLICY=PASSIVE" in environment
        assert not any(v.startswith(b"GOMP_SPINCOUNT=") for v in environment)
        for engine in (off, on):
            client = openai.AsyncOpenAI(base_url=engine.base_url, api_key=engine.api_key, max_retries=0)
            await engine.load_adapter("plain@1", str(plain))
            await engine.load_adapter("dora@1", str(dora))
            _, prompt, values = await first_token(client, "plain")
            close(values, reference.top(prompt, "a0"), 1e-4)
            assert (await engine.stats())["merged"] == ("plain@1" if engine is on else None)
            _, prompt, values = await first_token(client, "dora")
            close(values, reference.top(prompt, "a1"), 1e-4)
            stats = await engine.stats()
            assert stats["merged"] is None and stats["merge_passes"] == (1 if engine is on else 0)


def test_omp_wait_policy_option():
    with pytest.raises(
        ValueError, match="omp_wait_policy='spin': pass one of \\['auto', 'active', 'passive'\\]"
    ):
        HFEngine(models.tiny(), "base", "logs", omp_wait_policy="spin")
    assert omp_environment("auto", {}) == AUTO_OMP_ENV
    assert omp_environment("auto", {"GOMP_SPINCOUNT": "10"}) == {}, "the user's own setting wins over auto"
    assert omp_environment("active", {"OMP_WAIT_POLICY": "PASSIVE"}) == {"OMP_WAIT_POLICY": "ACTIVE"}
    assert omp_environment("passive", {}) == {"OMP_WAIT_POLICY": "PASSIVE"}
