"""The HF engine and the vLLM engine compute the same policy: equal first-token logprobs (fp32), base and LoRA.

Training uses the logprobs the engine returned as the old policy, so an engine whose numbers drift from the
trainer's (transformers + PEFT, as in the HF engine) would bias every importance ratio.
"""

from __future__ import annotations

import asyncio

import openai
import pytest
import torch

from artnb import models
from artnb.backends.engines.process import HFEngine
from artnb.backends.engines.vllm_engine import VLLMEngine, vllm_import_error

if (problem := vllm_import_error()) is not None:
    pytest.skip(f"the vLLM engine needs vLLM: {problem}", allow_module_level=True)

pytestmark = pytest.mark.slow
PROMPTS = [
    [{"role": "user", "content": "Say hello."}],
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "system", "content": "You play tic-tac-toe."}, {"role": "user", "content": "Your move?"}],
]
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(models.embedded_model_path())


@pytest.fixture(scope="module")
def adapter(model_path, tmp_path_factory) -> str:
    """An adapter like PeftTrainer's (r=8, alpha 16, all linear layers) with random weights, so it matters."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False)
    path = tmp_path_factory.mktemp("adapter") / "agent"
    get_peft_model(AutoModelForCausalLM.from_pretrained(model_path), config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
async def clients(model_path, adapter, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    hf = HFEngine(model_path, "base", logs, device="cpu")
    vllm = VLLMEngine(model_path, "base", logs, extra_args=["--max-model-len", "2048"])
    try:
        await asyncio.gather(hf.start(timeout=300), vllm.start(timeout=300))
        for engine in (hf, vllm):
            await engine.load_adapter("agent@1", adapter)
        yield {
            name: openai.AsyncOpenAI(base_url=e.base_url, api_key=e.api_key, max_retries=0)
            for name, e in (("hf", hf), ("vllm", vllm))
        }
    finally:
        await asyncio.gather(hf.stop(), vllm.stop())


async def first_token(
    client: openai.AsyncOpenAI, model: str, messages: list
) -> tuple[int, float, list[float]]:
    """The greedy first token, its logprob, and the top-5 logprobs (sorted, so near-ties may swap tokens)."""
    completion = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=1, temperature=0, logprobs=True, top_logprobs=5
    )
    choice = completion.choices[0]
    first = choice.logprobs.content[0]
    return choice.model_extra["token_ids"][0], first.logprob, sorted(t.logprob for t in first.top_logprobs)


@pytest.mark.parametrize("model", ["base", "agent"])
async def test_first_token_logprobs_match(clients, model):
    for messages in PROMPTS:
        hf, vllm = await asyncio.gather(*(first_token(clients[e], model, messages) for e in ("hf", "vllm")))
        assert hf[0] == vllm[0], f"{model}: greedy token differs for {messages}"
        assert vllm[1] == pytest.approx(hf[1], abs=TOLERANCE)
        assert vllm[2] == pytest.approx(hf[2], abs=TOLERANCE)


async def test_the_adapter_changes_the_logprobs(clients):
    base, tuned = [await first_token(clients["vllm"], m, PROMPTS[0]) for m in ("base", "agent")]
    assert abs(base[1] - tuned[1]) > 100 * TOLERANCE or base[0] != tuned[0]
