"""Decoding from slot buffers (hf/slots.py), the HF engine's default, against the dynamic cache it replaces.

What a user relies on: whichever way the engine decodes, a request gets the same tokens and logprobs (the
trainer recomputes them); a long rollout, a crowd of joining rows and rows finishing early change nothing; a
model the slots do not fit is served the dynamic way, and the engine says why.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from artnb import models
from artnb.backends.engines.hf.batching import Row, check_slots, decode_batch
from artnb.backends.engines.hf.slots import COLUMN_STEP, SlotDecoder, bucket

GQA = dict(models.TINY_QWEN2)  # grouped key/value heads and q/k/v biases: Qwen2.5's attention, at test size


@pytest.fixture(scope="module")
def qwen():
    path = models.random_model(GQA, dtype="float32")
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def decode(model, tokenizer, rows, slots=None, **kwargs):
    text = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    if slots is not None:
        slots.begin(model, key="base")
    decode_batch(model, rows, pad_id=0, eos_ids=[tokenizer.eos_token_id], decode=text, slots=slots, **kwargs)
    return rows


def test_slots_decode_as_the_dynamic_cache_while_rows_join_leave_and_grow_past_the_buffers(qwen):
    """Rows of different prompt lengths and lengths to sample, three joining beyond the first buffers' slots
    and one sampling past their columns: every row's tokens and logprobs are the dynamic cache's."""
    model, tokenizer = qwen

    def rows() -> list[Row]:
        lengths = [3, 40, 9, 1, COLUMN_STEP + 20, 5, 12]
        return [
            Row(tokenizer(f"row {i}: " + "go " * (i * 3)).input_ids, max_tokens=n, min_tokens=n, seed=i)
            for i, n in enumerate(lengths)
        ]

    def joining(rows: list[Row]):
        waiting = rows[4:]
        return lambda room: [waiting.pop(0)] if waiting else []

    expected = rows()
    decode(model, tokenizer, expected[:4], more=joining(expected), max_rows=8)
    slots = SlotDecoder(model)
    got = rows()
    decode(model, tokenizer, got[:4], slots, more=joining(got), max_rows=8)
    assert slots.allocations >= 3, "the buffers grew for more slots and for more columns"
    for a, b in zip(expected, got, strict=True):
        assert a.token_ids == b.token_ids and len(a.token_ids) == a.max_tokens
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5


def test_a_decoder_keeps_its_buffers_between_batches_and_grows_them_only_for_more_rows(qwen):
    """An engine's batches come one after another on the same buffers: they are allocated once per growth, not
    per batch, and what an earlier batch left in them (longer prompts, other slots) never reaches a later one's
    tokens. A release (the engine held for training) frees them; they come back at their largest size."""
    model, tokenizer = qwen

    def rows(n: int, words: int) -> list[Row]:
        return [
            Row(
                tokenizer(f"say {i}: " + "more " * (words + 3 * i)).input_ids,
                max_tokens=6,
                min_tokens=6,
                seed=10 * n + i,
            )
            for i in range(n)
        ]

    slots = SlotDecoder(model)
    allocations = []
    for n, words in ((1, 60), (5, 30), (2, 2), (3, 9)):  # later prompts shorter than what their slots held
        expected = decode(model, tokenizer, rows(n, words), SlotDecoder(model))
        got = decode(model, tokenizer, rows(n, words), slots)
        allocations.append(slots.allocations)
        for a, b in zip(expected, got, strict=True):
            assert len(b.token_ids) == 6 and a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert allocations == [1, 2, 2, 2]
    assert slots.cache is not None and (slots.cache.slots, slots.cache.columns) == (8, COLUMN_STEP)

    slots.release()
    assert slots.cache is None
    decode(model, tokenizer, rows(1, 1), slots)
    assert slots.cache is not None and (slots.cache.slots, slots.cache.columns) == (8, COLUMN_STEP)
    assert slots.allocations == 3, "one allocation at the largest size, not one per growth"
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 64, 65)] == [1, 2, 4, 4, 8, 64, 128]


def test_the_start_check_passes_full_attention_models_and_names_what_it_refuses(qwen):
    model, _ = qwen
    passed = check_slots(model, SlotDecoder(model), pad_id=0, eos_ids=[0])
    assert passed.problem is None and passed.difference < 1e-4

    sliding = {**GQA, "model_type": "mistral", "sliding_window": 16}
    mistral = AutoModelForCausalLM.from_pretrained(models.random_model(sliding, dtype="float32")).eval()
    refused = check_slots(mistral, SlotDecoder(mistral), pad_id=0, eos_ids=[0])
    assert refused.problem is not None and "sliding windows" in refused.problem

    bloom = {
        "model_type": "bloom",
        "n_head": 4,
        "n_layer": 2,
        "hidden_size": 64,
    }  # ALiBi, its own cache layout
    odd = AutoModelForCausalLM.from_pretrained(models.random_model(bloom, dtype="float32")).eval()
    failed = check_slots(odd, SlotDecoder(odd), pad_id=0, eos_ids=[0])
    assert failed.problem is not None and failed.problem.startswith("decoding from the slots failed")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_a_replayed_cuda_graph_samples_what_the_eager_step_samples():
    path = models.random_model(GQA, dtype="bfloat16")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    results = []
    for graphs in (False, True):
        slots = SlotDecoder(model, graphs=graphs)
        rows = [
            Row(tokenizer(f"row {i} " * (i + 1)).input_ids, max_tokens=n, min_tokens=n, seed=i)
            for i, n in enumerate((12, 8, 12))
        ]
        results.append(decode(model, tokenizer, rows, slots))
        assert slots.graphs.captures == (2 if graphs else 0)  # buckets 4 and, once a row left, 2
    for eager, replayed in zip(*results, strict=True):
        assert eager.token_ids == replayed.token_ids and eager.logprobs == replayed.logprobs
