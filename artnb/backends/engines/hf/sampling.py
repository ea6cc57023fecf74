"""One sampling step for a whole batch of rows, each with its own settings, in a few batched tensor operations.

Why not a loop over rows: on a GPU every per-row operation is a kernel launch and every `.item()` a device sync,
so a 64-row batch spent more time launching than computing (issue 25: the engine ran at 0.29-0.40x a plain
`generate`). Here a step costs the same handful of operations at 1 row or 64:

- The raw logprobs (log-softmax at temperature 1, before any mask) are taken first: they are what the trainer
  recomputes and what the engine reports, whatever the row's settings.
- Masks (a choice trie, a JSON grammar, EOS before `min_tokens`, penalties) touch only the rows that have one.
- Temperature and top_p are per-row tensors; the top-p sort runs only over the rows that ask for it.
- Unseeded rows draw from one generator in one `multinomial` call. Seeded rows draw from counter-based noise:
  the exponential race (`argmax(p / E)`, E ~ Exp(1), the same distribution as multinomial sampling) with E
  computed from a hash of (seed, token index, vocabulary id). A seeded row's tokens therefore depend on nothing
  but its own logits: the same whichever rows share its batch, whenever it joined it, on any device.
- The sampled ids and their logprobs stay on the device until one copy to the host at the end of the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

_MASK32 = 0xFFFFFFFF


class SamplingRow(Protocol):
    """What sampling reads of a row: hf/batching.py's `Row` (not imported: batching imports this module)."""

    temperature: float  # 0 means greedy
    top_p: float
    seed: int | None
    top_logprobs: int
    token_ids: list[int]  # sampled so far: a seeded row's next key


def _mix64(value: int) -> int:
    """SplitMix64's finalizer (on Python ints): a well-spread 64-bit key from a seed and a position."""
    value &= (1 << 64) - 1
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return value ^ (value >> 31)


def row_key(seed: int, index: int) -> int:
    """The 32-bit key of the `index`-th token of a row seeded with `seed`."""
    return _mix64(_mix64(seed) ^ (index + 1) * 0x9E3779B97F4A7C15) & _MASK32


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """x * constant mod 2**32 for int64 x < 2**32, in two halves so that no product leaves int64's range."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (xor-shift-multiply rounds) on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_uniform(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform (0, 1) floats of shape [len(keys), vocab], a pure function of each row's key and the token id."""
    ids = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    return unit_interval(_hash32((keys[:, None] ^ _mul32(ids, 0x9E3779B1)[None, :]) & _MASK32))


def unit_interval(bits: torch.Tensor) -> torch.Tensor:
    """32 random bits to a float32 strictly inside (0, 1): 23 bits, so that the largest value stays below 1
    (with 24, (2**24 - 0.5) / 2**24 rounds to 1.0, and -log(1.0) = 0 noise turns a masked token into NaN)."""
    return ((bits >> 9).to(torch.float32) + 0.5) / float(1 << 23)


@dataclass
class Settings:
    """The batch's per-row settings as tensors, rebuilt only when the batch's rows change."""

    temperature: torch.Tensor  # [B, 1], 1.0 where the row is greedy (its division is unused)
    any_greedy: bool  # some rows take the argmax (temperature 0)
    plain: bool  # every row samples, unseeded, without top_p: one draw over the whole batch
    temperature_one: bool  # every temperature is 1: no division
    top_p: torch.Tensor  # [B]
    top_p_rows: torch.Tensor | None  # indices of rows with 0 < top_p < 1 that sample
    seeded: list[int]  # rows drawing counter-based noise
    seeds: list[int]  # their seeds, in the same order
    unseeded: torch.Tensor | None  # indices of the other sampling rows
    top_k: int  # the most top logprobs any row asked for

    @classmethod
    def of(cls, rows: Sequence[SamplingRow], device: torch.device) -> Settings:
        greedy = [r.temperature == 0 for r in rows]
        top_p = [j for j, r in enumerate(rows) if 0 < r.top_p < 1 and not greedy[j]]
        seeded = [j for j, r in enumerate(rows) if r.seed is not None and not greedy[j]]
        seeds = [r.seed for j, r in enumerate(rows) if r.seed is not None and not greedy[j]]
        unseeded = [j for j, r in enumerate(rows) if r.seed is None and not greedy[j]]
        temperatures = [r.temperature if r.temperature > 0 else 1.0 for r in rows]
        return cls(
            temperature=torch.tensor(temperatures, device=device)[:, None],
            any_greedy=any(greedy),
            plain=len(unseeded) == len(rows) and not top_p,
            temperature_one=all(t == 1.0 for t in temperatures),
            top_p=torch.tensor([r.top_p for r in rows], device=device),
            top_p_rows=torch.tensor(top_p, device=device) if top_p else None,
            seeded=seeded,
            seeds=seeds,
            unseeded=torch.tensor(unseeded, device=device) if unseeded else None,
            top_k=max((r.top_logprobs for r in rows), default=0),
        )


@dataclass
class Sampled:
    """One step's result on the host: a token, its raw logprob and the asked-for top logprobs, per row."""

    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]
    ids: torch.Tensor  # the tokens again, still on the device: the next step's input without a copy back


def sample(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    settings: Settings,
    masks: Sequence[Callable[[torch.Tensor], None]],
    generator: torch.Generator,
) -> Sampled:
    """Pick one token per row of `logits` [B, V].

    Each of `masks` sets, in place, the scores its rows may not sample to -inf (or lowers them: penalties); they
    apply to a copy of the raw logprobs, which stay as they are. Sampling works on those log-space scores over
    the temperature (a per-row shift changes neither a softmax nor an argmax), with unnormalised weights where
    that is exact, so the common step (temperature 1, no masks) costs the log-softmax, one exp and the draw.
    """
    logits = logits.float()
    raw = torch.log_softmax(logits, dim=-1)
    scores = raw  # log-space; any per-row shift samples the same
    if masks:
        scores = (
            logits.contiguous()
        )  # the model's output, ours to mask in place (xgrammar wants it contiguous)
        for apply in masks:
            apply(scores)
    chosen = scores.argmax(dim=-1) if settings.any_greedy else None
    if settings.seeded or settings.unseeded is not None:
        scaled = scores if settings.temperature_one else scores / settings.temperature
        if scaled is not raw:
            scaled = scaled - scaled.amax(
                dim=-1, keepdim=True
            )  # <= 0, so exp() neither overflows nor empties a row
        if settings.top_p_rows is not None:
            index = settings.top_p_rows
            scaled = scaled.clone() if scaled is raw else scaled
            scaled[index] = top_p_filter(scaled[index], settings.top_p[index])
        if settings.plain:
            chosen = draw(scaled.exp(), generator)
        else:
            if chosen is None:
                chosen = torch.zeros(len(rows), dtype=torch.long, device=raw.device)
            if settings.unseeded is not None:
                index = settings.unseeded
                chosen[index] = draw(scaled[index].exp(), generator)
            if settings.seeded:
                index = torch.tensor(settings.seeded, device=raw.device)
                keys = torch.tensor(
                    [
                        row_key(seed, len(rows[j].token_ids))
                        for j, seed in zip(settings.seeded, settings.seeds, strict=True)
                    ],
                    device=raw.device,
                )
                noise = -torch.log(counter_uniform(keys, raw.shape[-1]))  # Exp(1)
                chosen[index] = (scaled[index] - torch.log(noise)).argmax(dim=-1)
    assert chosen is not None  # every row is greedy, seeded or unseeded
    chosen_lp = raw.gather(1, chosen[:, None])[:, 0]
    host = torch.stack([chosen.to(torch.float64), chosen_lp.to(torch.float64)]).cpu()  # the one copy
    tokens = [int(t) for t in host[0].tolist()]
    top: list[list[tuple[int, float]]] = [[] for _ in rows]
    if settings.top_k > 0:
        values, ids = (t.cpu() for t in raw.topk(settings.top_k, dim=-1))
        for j, row in enumerate(rows):
            k = row.top_logprobs
            top[j] = list(zip(ids[j, :k].tolist(), values[j, :k].tolist(), strict=True))
    return Sampled(tokens, host[1].tolist(), top, chosen)


def draw(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index per row, with probability proportional to the row's non-negative `weights` (not normalised).

    Inverse-CDF sampling: a float64 cumulative sum (exact enough that a token of probability 1e-12 keeps its
    share) and one uniform per row. The same distribution as `torch.multinomial`, at a fraction of its CPU cost
    (it walks each row serially: 100 ms for 64 rows of 49,152 tokens on 2 cores, against a few ms here).
    """
    cdf = weights.to(torch.float64).cumsum(dim=-1)
    u = torch.rand((len(weights), 1), generator=generator, device=weights.device, dtype=torch.float64)
    index = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0]
    return index.clamp(max=weights.shape[-1] - 1)


def top_p_filter(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, keep the smallest set of tokens whose probability mass reaches its top_p (at least one)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    drop = probs.cumsum(-1) - probs >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
