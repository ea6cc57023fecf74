"""The HF engine's decoding loop and batched sampler, run in this process on the tiny model.

What a user relies on: a seeded request gives the same tokens alone, in a batch, or joining a batch already
decoding; reported logprobs are the model's own (log-softmax at temperature 1, before any setting or mask);
per-row settings and constraints stay per row when rows of every kind share a batch.
"""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from artnb import models
from artnb.backends.engines.hf.batching import ChoiceTrie, Row, Scheduler, decode_batch, prefill_chunks
from artnb.backends.engines.hf.sampling import counter_uniform, draw, row_key, top_p_filter, unit_interval


@pytest.fixture(scope="module")
def tiny():
    path = models.tiny()
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def prompts(tokenizer, n: int) -> list[list[int]]:
    """Prompts of different lengths, so rows are padded differently in every batch."""
    return [tokenizer(f"note {i}: " + "words " * (1 + 3 * (i % 4))).input_ids for i in range(n)]


def run(model, tokenizer, rows: list[Row], **kwargs) -> list[Row]:
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    decode_batch(model, rows, pad_id=0, eos_ids=[tokenizer.eos_token_id], decode=decode, **kwargs)
    return rows


def seeded(tokenizer, n: int, **settings) -> list[Row]:
    return [Row(p, max_tokens=10, seed=100 + i, **settings) for i, p in enumerate(prompts(tokenizer, n))]


def test_seeded_rows_reproduce_alone_in_a_batch_and_joining_mid_batch(tiny):
    model, tokenizer = tiny
    together = run(model, tokenizer, seeded(tokenizer, 6))
    alone = [run(model, tokenizer, [row])[0] for row in seeded(tokenizer, 6)]
    joining = seeded(tokenizer, 6)
    waiting, asks = joining[1:], []

    def more(n: int) -> list[Row]:  # one row joins every other step, the last two together
        asks.append(n)
        if len(asks) % 2 == 0 and waiting:
            return [waiting.pop(0)] if len(waiting) > 2 else [waiting.pop(0), waiting.pop(0)]
        return []

    run(model, tokenizer, joining[:1], more=more, max_rows=6)
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
    model, tokenizer = tiny
    long_prompt = tokenizer("history " * 600).input_ids
    batch = [Row(p, max_tokens=6, seed=7 + i) for i, p in enumerate([*prompts(tokenizer, 5), long_prompt])]
    chunks = prefill_chunks(batch)
    assert [len(c) for c in chunks] == [5, 1] and chunks[1][0].prompt_ids == long_prompt
    same = [Row(p, max_tokens=6, seed=7 + i) for i, p in enumerate(prompts(tokenizer, 40))]
    assert len(prefill_chunks(same)) == 1, "prompts of similar lengths share one pass"
    together = run(model, tokenizer, batch)
    alone = [run(model, tokenizer, [Row(r.prompt_ids, max_tokens=6, seed=r.seed)])[0] for r in batch]
    for a, b in zip(together, alone, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5


def test_logprobs_are_the_models_at_temperature_one_whatever_the_settings(tiny):
    model, tokenizer = tiny
    rows = [
        Row(p, max_tokens=8, temperature=t, top_p=top_p, seed=s)
        for p, (t, top_p, s) in zip(
            prompts(tokenizer, 4),
            [(0.0, 1.0, None), (0.7, 0.9, 3), (1.3, 1.0, None), (1.0, 0.5, None)],
            strict=True,
        )
    ]
    run(model, tokenizer, rows)
    for row in rows:
        ids = torch.tensor([row.prompt_ids + row.token_ids])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        start = len(row.prompt_ids) - 1
        expected = [logprobs[start + k, t].item() for k, t in enumerate(row.token_ids)]
        assert max(abs(a - b) for a, b in zip(row.logprobs, expected, strict=True)) < 1e-5


def test_greedy_rows_take_the_argmax_beside_sampling_rows(tiny):
    model, tokenizer = tiny
    greedy = [Row(p, max_tokens=6, temperature=0.0) for p in prompts(tokenizer, 3)]
    mixed = [Row(p, max_tokens=6, temperature=0.0) for p in prompts(tokenizer, 3)]
    mixed += [Row(p, max_tokens=6, temperature=1.5) for p in prompts(tokenizer, 3)]
    run(model, tokenizer, greedy)
    run(model, tokenizer, mixed)
    assert [r.token_ids for r in mixed[:3]] == [r.token_ids for r in greedy]
    for row in greedy:  # each token is the one with the highest raw logprob: the reported one is the max
        assert all(lp > math.log(1 / 49152) for lp in row.logprobs)


def test_constraints_and_stops_stay_with_their_rows(tiny):
    model, tokenizer = tiny
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
    run(model, tokenizer, rows[:3], more=lambda n: [waiting.pop()] if waiting else [], max_rows=8)
    run(model, tokenizer, rows[3:])
    for row in (rows[0], joiner):
        text = tokenizer.decode(row.token_ids, skip_special_tokens=True)
        assert text in choices and row.finish_reason == "stop"
    stopped = tokenizer.decode(rows[1].token_ids, skip_special_tokens=True)
    assert rows[1].finish_reason == "length" or ("e" in stopped and rows[1].finish_reason == "stop")
    assert len(rows[2].token_ids) == 12 and rows[2].finish_reason == "length"
    assert len(rows[3].token_ids) == 5


def test_on_finish_reports_each_row_as_it_ends(tiny):
    model, tokenizer = tiny
    rows = [Row(p, max_tokens=n, seed=n) for p, n in zip(prompts(tokenizer, 3), (2, 9, 5), strict=True)]
    ended: list[tuple[int, int]] = []
    run(model, tokenizer, rows, on_finish=lambda row: ended.append((row.max_tokens, len(row.token_ids))))
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


async def test_rows_join_a_running_batch_until_another_models_row_waits():
    """The scheduler's side of continuous batching, with a decoder that only records what it was given: rows of
    the running model join between steps; a queued row of another model stops the joining (the batch drains and
    that model runs next); a request is answered when its own rows end, not when its batch does."""
    batches: list[tuple[str, list[int]]] = []

    def run_batch(model, rows, more, on_finish):
        batches.append((model, [r.prompt_ids[0] for r in rows]))
        for _ in range(12):
            for row in more(8):
                batches[-1][1].append(row.prompt_ids[0])
                rows.append(row)
            for row in rows:  # a row ends the step after it came in
                if row.finish_reason is None and row.token_ids:
                    row.finish_reason = "length"
                    on_finish(row)
                row.token_ids.append(0)
            time.sleep(0.03)
        for row in rows:
            if row.finish_reason is None:
                row.finish_reason = "length"
                on_finish(row)

    scheduler = Scheduler(lambda name: name, run_batch, max_batch_size=8)
    scheduler.start()
    first = asyncio.create_task(scheduler.submit("a", [Row([1], max_tokens=1)]))
    while not batches:
        await asyncio.sleep(0.005)
    assert await scheduler.submit("a", [Row([2], max_tokens=1)]) == "a"  # joined, answered mid-batch
    assert scheduler.stats["running"] == 1 and len(batches) == 1  # its batch is still decoding
    other = asyncio.create_task(scheduler.submit("b", [Row([3], max_tokens=1)]))
    late = asyncio.create_task(scheduler.submit("a", [Row([4], max_tokens=1)]))
    assert await asyncio.gather(first, other, late) == ["a", "b", "a"]
    assert batches == [("a", [1, 2]), ("b", [3]), ("a", [4])]
    assert scheduler.stats["joined_rows"] == 1


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
