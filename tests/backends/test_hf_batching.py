"""The HF engine's decoding loop and batched sampler, run in this process on the tiny model, decoding from the
engine's slot buffers (its default, hf/slots.py) and from a dynamic cache (every other model).

What a user relies on: a seeded request gives the same tokens alone, in a batch, or joining a batch already
decoding; reported logprobs are the model's own (log-softmax at temperature 1, before any setting or mask);
per-row settings and constraints stay per row when rows of every kind share a batch.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from artnb import models
from artnb.backends.engines.hf.batching import ChoiceTrie, Row, decode_batch, prefill_chunks
from artnb.backends.engines.hf.sampling import counter_uniform, draw, row_key, top_p_filter, unit_interval
from artnb.backends.engines.hf.slots import SlotDecoder


@pytest.fixture(scope="module", params=["slots", "dynamic"])
def tiny(request):
    """The model and tokenizer, and the engine's slot decoder (kept across batches, as the engine keeps it) or
    None for the dynamic cache."""
    path = models.tiny()
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    return (
        model,
        AutoTokenizer.from_pretrained(path),
        SlotDecoder(model) if request.param == "slots" else None,
    )


def prompts(tokenizer, n: int) -> list[list[int]]:
    """Prompts of different lengths, so rows are padded differently in every batch."""
    return [tokenizer(f"note {i}: " + "words " * (1 + 3 * (i % 4))).input_ids for i in range(n)]


def run(tiny, rows: list[Row], **kwargs) -> list[Row]:
    model, tokenizer, slots = tiny
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    if slots is not None:  # the module's decoder: its buffers go from test to test, as in an engine
        slots.begin(model, key="base")
    decode_batch(
        model, rows, pad_id=0, eos_ids=[tokenizer.eos_token_id], decode=decode, slots=slots, **kwargs
    )
    return rows


def seeded(tokenizer, n: int, **settings) -> list[Row]:
    return [Row(p, max_tokens=10, seed=100 + i, **settings) for i, p in enumerate(prompts(tokenizer, n))]


def test_seeded_rows_reproduce_alone_in_a_batch_and_joining_mid_batch(tiny):
    model, tokenizer, _ = tiny
    together = run(tiny, seeded(tokenizer, 6))
    alone = [run(tiny, [row])[0] for row in seeded(tokenizer, 6)]
    joining = seeded(tokenizer, 6)
    waiting, asks = joining[1:], []

    def more(n: int) -> list[Row]:  # one row joins every other step, the last two together
        asks.append(n)
        if len(asks) % 2 == 0 and waiting:
            return [waiting.pop(0)] if len(waiting) > 2 else [waiting.pop(0), waiting.pop(0)]
        return []

    run(tiny, joining[:1], more=more, max_rows=6)
    assert not waiting and asks[0] == 5  # room left beside the first row
    for a, b, c in zip(together, alone, joining, strict=True):
        assert a.token_ids == b.token_ids == c.token_ids
        assert a.finish_reason == b.finish_reason == c.finish_reason == "length"
        assert max(abs(x - y) for x, y in zip(a.logprobs, c.logprobs, strict=True)) < 1e-5
    assert len({tuple(r.token_ids) for r in together}) > 1, "different seeds sample differently"


def test_one_long_prompt_is_prefilled_apart_and_every_row_samples_as_alone(tiny):
    """A grown multi-turn conversation among short prompts: prefilled in one padded pass, every short row cost
    as much as the long one. Chunks of similar lengths are prefilled one after another and merged; the rows
    sample what they sample alone."""
    model, tokenizer, _ = tiny
    long_prompt = tokenizer("history " * 600).input_ids
    batch = [Row(p, max_tokens=6, seed=7 + i) for i, p in enumerate([*prompts(tokenizer, 5), long_prompt])]
    chunks = prefill_chunks(batch)
    assert [len(c) for c in chunks] == [5, 1] and chunks[1][0].prompt_ids == long_prompt
    same = [Row(p, max_tokens=6, seed=7 + i) for i, p in enumerate(prompts(tokenizer, 40))]
    assert len(prefill_chunks(same)) == 1, "prompts of similar lengths share one pass"
    together = run(tiny, batch)
    alone = [run(tiny, [Row(r.prompt_ids, max_tokens=6, seed=r.seed)])[0] for r in batch]
    for a, b in zip(together, alone, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5


def test_logprobs_are_the_models_at_temperature_one_whatever_the_settings(tiny):
    model, tokenizer, _ = tiny
    rows = [
        Row(p, max_tokens=8, temperature=t, top_p=top_p, seed=s)
        for p, (t, top_p, s) in zip(
            prompts(tokenizer, 4),
            [(0.0, 1.0, None), (0.7, 0.9, 3), (1.3, 1.0, None), (1.0, 0.5, None)],
            strict=True,
        )
    ]
    run(tiny, rows)
    for row in rows:
        ids = torch.tensor([row.prompt_ids + row.token_ids])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        start = len(row.prompt_ids) - 1
        expected = [logprobs[start + k, t].item() for k, t in enumerate(row.token_ids)]
        assert max(abs(a - b) for a, b in zip(row.logprobs, expected, strict=True)) < 1e-5


def test_greedy_rows_take_the_argmax_beside_sampling_rows(tiny):
    model, tokenizer, _ = tiny
    greedy = [Row(p, max_tokens=6, temperature=0.0) for p in prompts(tokenizer, 3)]
    mixed = [Row(p, max_tokens=6, temperature=0.0) for p in prompts(tokenizer, 3)]
    mixed += [Row(p, max_tokens=6, temperature=1.5) for p in prompts(tokenizer, 3)]
    run(tiny, greedy)
    run(tiny, mixed)
    assert [r.token_ids for r in mixed[:3]] == [r.token_ids for r in greedy]
    for row in greedy:  # each token is the one with the highest raw logprob: the reported one is the max
        assert all(lp > math.log(1 / 49152) for lp in row.logprobs)


def test_constraints_and_stops_stay_with_their_rows(tiny):
    model, tokenizer, _ = tiny
    choices = ["yes", "no", "maybe"]
    trie = ChoiceTrie([tokenizer(c, add_special_tokens=False).input_ids for c in choices])
    base = prompts(tokenizer, 4)
    rows = [
        Row(base[0], max_tokens=8, choices=trie, seed=1),
        Row(base[1], max_tokens=40, stop=["e"], seed=2),
        Row(base[2], max_tokens=12, min_tokens=12, seed=3),
        Row(base[3], max_tokens=5, seed=4),
    ]
    joiner = Row(base[0], max_tokens=8, choices=trie, seed=5)
    waiting = [joiner]
    run(tiny, rows[:3], more=lambda n: [waiting.pop()] if waiting else [], max_rows=8)
    run(tiny, rows[3:])
    for row in (rows[0], joiner):
        text = tokenizer.decode(row.token_ids, skip_special_tokens=True)
        assert text in choices and row.finish_reason == "stop"
    stopped = tokenizer.decode(rows[1].token_ids, skip_special_tokens=True)
    assert rows[1].finish_reason == "length" or ("e" in stopped and rows[1].finish_reason == "stop")
    assert len(rows[2].token_ids) == 12 and rows[2].finish_reason == "length"
    assert len(rows[3].token_ids) == 5


def test_on_finish_reports_each_row_as_it_ends(tiny):
    model, tokenizer, _ = tiny
    rows = [Row(p, max_tokens=n, seed=n) for p, n in zip(prompts(tokenizer, 3), (2, 9, 5), strict=True)]
    ended: list[tuple[int, int]] = []
    run(tiny, rows, on_finish=lambda row: ended.append((row.max_tokens, len(row.token_ids))))
    assert ended == [(2, 2), (5, 5), (9, 9)]


def test_counter_noise_is_uniform_and_a_pure_function_of_the_key():
    keys = torch.tensor([row_key(7, 0), row_key(7, 1), row_key(8, 0)])
    u = counter_uniform(keys, 50_000)
    assert torch.equal(u, counter_uniform(keys, 50_000))
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    extremes = unit_interval(torch.tensor([0, 0xFFFFFFFF]))
    assert 0 < extremes[0] and extremes[1] < 1, "a uniform of exactly 0 or 1 makes -log(-log u) infinite"


def test_exponential_race_samples_the_softmax_distribution():
    """Sampling with the counter noise hits each token at its probability (a chi-square-sized tolerance)."""
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    probs = torch.softmax(logits, 0)
    keys = torch.tensor([row_key(1, i) for i in range(20_000)])
    noise = -torch.log(counter_uniform(keys, 4))
    counts = torch.bincount((torch.log_softmax(logits, 0) - torch.log(noise)).argmax(-1), minlength=4)
    assert torch.allclose(counts / 20_000, probs, atol=0.012)


def test_top_p_keeps_the_smallest_set_reaching_p_per_row():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    kept = top_p_filter(logits.clone(), torch.tensor([0.7, 0.3]))
    assert torch.isfinite(kept[0]).tolist() == [True, True, False, False]
    assert torch.isfinite(kept[1]).tolist() == [True, False, False, False]


def test_draw_samples_in_proportion_to_unnormalised_weights_and_never_a_zero_weight():
    weights = torch.tensor([[4.0, 0.0, 2.0, 1.0, 0.0]] * 20_000) * 7.5
    picked = draw(weights, torch.Generator().manual_seed(0))
    counts = torch.bincount(picked, minlength=5) / 20_000
    assert counts[1] == counts[4] == 0
    assert torch.allclose(counts, torch.tensor([4, 0, 2, 1, 0]) / 7, atol=0.012)


def test_a_masked_token_is_never_sampled_by_a_seeded_row():
    """Thousands of seeded draws over a full vocabulary where two tokens are allowed (a choice constraint)."""
    from artnb.backends.engines.hf.sampling import Settings, sample

    vocab, n = 49_152, 400
    logits = torch.randn(n, vocab) * 5
    allowed = torch.tensor([49, 50])

    def only_two(scores: torch.Tensor) -> None:
        kept = scores[:, allowed].clone()
        scores.fill_(float("-inf"))
        scores[:, allowed] = kept

    for round_ in range(4):
        rows = [Row([1], max_tokens=1, seed=round_ * n + i) for i in range(n)]
        picked = sample(logits.clone(), rows, Settings.of(rows, "cpu"), [only_two], torch.Generator())
        assert set(picked.tokens) <= {49, 50}
