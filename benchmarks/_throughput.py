"""Tokens per second of a plain `model.generate` call and of an engine's OpenAI endpoint on the same chats: the
one measurement that benchmarks/rollout_throughput.py and benchmarks/engine_batching.py compare, written once so
both sides of every ratio do the same work (exactly `tokens` sampled per chat at temperature 1)."""

from __future__ import annotations

import asyncio
import time

import openai
import torch

Chat = list[dict[str, str]]


def generate_tokens_per_s(model, tokenizer, chats: list[Chat], tokens: int) -> float:
    """One `generate` call on all `chats` (padded), EOS held off until `tokens` new tokens."""
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
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
    return len(chats) * tokens / elapsed


async def engine_tokens_per_s(
    client: openai.AsyncOpenAI, model: str, chats: list[Chat], tokens: int
) -> float:
    """Every chat sent at once to `model` through the OpenAI client, each sampling exactly `tokens`."""

    async def one(messages: Chat) -> int:
        completion = await client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            temperature=1.0,
            max_tokens=tokens,
            extra_body={"min_tokens": tokens},
        )
        assert completion.usage is not None
        return completion.usage.completion_tokens

    start = time.perf_counter()
    counts = await asyncio.gather(*[one(c) for c in chats])
    elapsed = time.perf_counter() - start
    assert counts == [tokens] * len(chats), counts
    return sum(counts) / elapsed
