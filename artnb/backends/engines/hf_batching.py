"""The HF engine's decoding loop and request scheduler.

Why a hand-written loop instead of `model.generate`: every row of a batch needs its own temperature, top_p,
max_tokens, stop strings, seed and output constraint (a choice trie or a JSON grammar, see hf_grammar.py),
and the engine must report the raw log-probability of every sampled token. Design choices:

- Left-padded batch, `position_ids` from the attention mask, a `DynamicCache`, and a prefill that keeps only
  the last position's logits (`logits_to_keep=1`), so the prompt never pays for a full-vocabulary projection.
- Finished rows leave the batch (the KV cache is re-indexed), so a long straggler does not keep paying for
  rows that stopped early. So do rows whose client went away (`Row.cancelled`, set from the event loop and
  read by the decoding thread at each step), with finish_reason "abort"; their queued rows never run.
- Reported logprobs are the model's log-softmax at temperature 1, before the choice or grammar mask,
  temperature or top_p: that is what the trainer recomputes, and what vLLM reports by default.
- Each row samples with its own `torch.Generator`, so a seeded request is reproducible whatever else runs.
- A streamed row's `on_token` is called after each token it gains (and once when it finishes), so the server
  can send tokens as they are sampled; the callback only wakes the event loop, it never blocks decoding.
- The scheduler batches requests that arrive within a few milliseconds of each other, runs one adapter's
  rows per batch in a worker thread, and resolves model names only when a batch is formed, so a request
  queued during `hold` runs on the adapter loaded before `release`.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from artnb.backends.engines.hf_grammar import JsonConstraint, mask_logits

_END = -1  # trie key marking "a complete choice ends here"


class ChoiceTrie:
    """Token-prefix trie over the tokenizations of the allowed choices."""

    def __init__(self, token_sequences: list[list[int]]):
        self.root: dict[int, Any] = {}
        for tokens in token_sequences:
            node = self.root
            for token in tokens:
                node = node.setdefault(token, {})
            node[_END] = {}

    @staticmethod
    def allowed(node: dict[int, Any], eos_id: int) -> list[int]:
        """Tokens that may follow `node`: its children, plus EOS where a choice is complete."""
        return [eos_id if token == _END else token for token in node]


@dataclass
class Row:
    """One sequence to sample: the request's settings in, the sampled tokens out."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None  # None: a fresh random seed
    choices: ChoiceTrie | None = None
    grammar: JsonConstraint | None = None  # this row's own matcher (never shared between rows)
    top_logprobs: int = 0
    min_tokens: int = 0  # EOS is masked until this many tokens were sampled (benchmarks, vLLM's min_tokens)
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token already sampled in this row
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per earlier occurrence of the token
    on_token: Callable[[], None] | None = (
        None  # called on the decoding thread after each token and at the end
    )
    job: Any = None  # the scheduler's handle on the request this row belongs to
    cancelled: bool = False  # the client went away: leave the batch at the next step (finish_reason "abort")
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None


def _sample(
    logits: torch.Tensor,
    rows: list[Row],
    nodes: list[dict | None],
    gens: list[torch.Generator],
    eos_ids: list[int],
) -> tuple[list[int], list[float], list[list[tuple[int, float]]]]:
    """Pick one token per row; return the tokens, their raw logprobs and the requested top logprobs."""
    logits = logits.float().contiguous()  # masks below write in place (xgrammar needs contiguous rows)
    raw = torch.log_softmax(logits, dim=-1)
    for j, node in enumerate(nodes):
        if node is not None:
            allowed = torch.tensor(ChoiceTrie.allowed(node, eos_ids[0]), device=logits.device)
            masked = torch.full_like(logits[j], float("-inf"))
            masked[allowed] = logits[j, allowed]
            logits[j] = masked
    mask_logits(logits, [row.grammar for row in rows])
    for j, row in enumerate(rows):
        if len(row.token_ids) < row.min_tokens and row.choices is None and row.grammar is None:
            logits[j, eos_ids] = float("-inf")
        if row.token_ids and (row.presence_penalty or row.frequency_penalty):
            counts = torch.bincount(torch.tensor(row.token_ids), minlength=logits.shape[-1]).to(logits.device)
            seen = counts > 0
            logits[j] -= row.presence_penalty * seen + row.frequency_penalty * counts
    temps = torch.tensor([r.temperature if r.temperature > 0 else 1.0 for r in rows], device=logits.device)
    scaled = logits / temps[:, None]
    for j, row in enumerate(rows):
        if 0 < row.top_p < 1 and row.temperature > 0:
            scaled[j] = _top_p_filter(scaled[j], row.top_p)
    probs = torch.softmax(scaled, dim=-1)
    greedy = logits.argmax(dim=-1)
    chosen = [
        int(greedy[j]) if row.temperature == 0 else int(torch.multinomial(probs[j], 1, generator=gens[j]))
        for j, row in enumerate(rows)
    ]
    index = torch.tensor(chosen, device=logits.device)
    chosen_lp = raw.gather(1, index[:, None])[:, 0].tolist()
    top: list[list[tuple[int, float]]] = [[] for _ in rows]
    k = max(r.top_logprobs for r in rows)
    if k > 0:
        values, ids = raw.topk(k, dim=-1)
        for j, row in enumerate(rows):
            top[j] = list(
                zip(ids[j, : row.top_logprobs].tolist(), values[j, : row.top_logprobs].tolist(), strict=True)
            )
    return chosen, chosen_lp, top


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability mass reaches top_p (always at least one)."""
    sorted_logits, order = logits.sort(descending=True)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    drop = cumulative - sorted_logits.softmax(-1) >= top_p
    sorted_logits[drop] = float("-inf")
    return torch.empty_like(logits).scatter_(0, order, sorted_logits)


def _hit_stop(row: Row, decode: Callable[[list[int]], str], tail_tokens: int) -> bool:
    text = decode(row.token_ids[-tail_tokens:])
    return any(s in text for s in row.stop)


def _notify(row: Row) -> None:
    if row.on_token is not None:
        row.on_token()


@torch.inference_mode()
def decode_batch(
    model: Any, rows: list[Row], *, pad_id: int, eos_ids: list[int], decode: Callable[[list[int]], str]
) -> None:
    """Sample every row to completion in one decoding loop, filling token_ids, logprobs and finish_reason.

    `eos_ids[0]` is the token a choice constraint forces once a choice is complete.
    """
    device = model.device
    width = max(len(r.prompt_ids) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, width - len(row.prompt_ids) :] = torch.tensor(row.prompt_ids)
        mask[i, width - len(row.prompt_ids) :] = 1
    input_ids, mask = input_ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    gens = [
        torch.Generator(device=device).manual_seed(r.seed if r.seed is not None else secrets.randbits(63))
        for r in rows
    ]
    nodes: list[dict | None] = [r.choices.root if r.choices else None for r in rows]
    # A stop string of c characters spans at most c tokens, plus a few for a character split into bytes.
    tails = [4 * max(map(len, r.stop)) + 4 if r.stop else 0 for r in rows]
    cache = DynamicCache(config=model.config)
    out = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    logits = out.logits[:, -1, :]
    next_pos = positions[:, -1] + 1
    active = list(range(len(rows)))
    while True:
        batch_rows = [rows[i] for i in active]
        tokens, lps, tops = _sample(
            logits, batch_rows, [nodes[i] for i in active], [gens[i] for i in active], eos_ids
        )
        keep: list[int] = []
        for j, i in enumerate(active):
            row, token = rows[i], tokens[j]
            if row.cancelled:
                row.finish_reason = "abort"
                _notify(row)
                continue
            row.token_ids.append(token)
            row.logprobs.append(lps[j])
            row.top.append(tops[j])
            if nodes[i] is not None:
                nodes[i] = nodes[i].get(token, {})
            if row.grammar is not None:
                row.grammar.accept(token)
            if token in eos_ids or (row.stop and _hit_stop(row, decode, tails[i])):
                row.finish_reason = "stop"
            elif len(row.token_ids) >= row.max_tokens:
                row.finish_reason = "length"
            else:
                keep.append(j)
            _notify(row)
        if not keep:
            return
        if len(keep) < len(active):
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            mask, next_pos = mask[index], next_pos[index]
            active = [active[j] for j in keep]
            tokens = [tokens[j] for j in keep]
        mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=-1)
        out = model(
            input_ids=torch.tensor(tokens, device=device)[:, None],
            attention_mask=mask,
            position_ids=next_pos[:, None],
            past_key_values=cache,
            use_cache=True,
        )
        logits = out.logits[:, -1, :]
        next_pos = next_pos + 1


@dataclass
class _Job:
    model: str
    rows: list[Row]
    future: asyncio.Future
    resolved: str | None = None  # the model name the rows ran on, fixed when the first rows are scheduled


class Scheduler:
    """Queues requests, batches them, and runs each batch in a worker thread; supports hold/release.

    `resolve(name)` maps a requested model name to the name that serves it (raising for unknown names);
    `run_batch(resolved_name, rows)` decodes the rows (blocking; it runs in a worker thread).
    """

    def __init__(
        self,
        resolve: Callable[[str], str],
        run_batch: Callable[[str, list[Row]], None],
        max_batch_size: int,
        quiet_s: float = 0.01,  # a batch forms once no request arrived for this long...
        max_wait_s: float = 0.05,  # ...or after this long, whichever comes first
    ):
        self.resolve, self.run_batch, self.max_batch_size = resolve, run_batch, max_batch_size
        self.quiet_s, self.max_wait_s = quiet_s, max_wait_s
        self._pending: deque[Row] = deque()
        self._arrivals = 0
        self._work = asyncio.Event()
        self._released = asyncio.Event()
        self._released.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.stats = {
            "requests": 0,
            "rows": 0,  # rows decoded (aborted ones included)
            "batches": 0,
            "running": 0,
            "held": False,
            "aborted_rows": 0,  # left a running batch because their client disconnected
            "dropped_rows": 0,  # removed from the queue before running, because their client disconnected
        }
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def submit(self, model: str, rows: list[Row]) -> str:
        """Queue rows for `model`; return the model name they ran on once all are finished.

        Cancelling the caller (its client went away) cancels the rows: queued ones are dropped, running ones
        leave their batch at the next decoding step.
        """
        job = _Job(model, rows, asyncio.get_running_loop().create_future())
        for row in rows:
            row.job = job
        self._pending.extend(rows)
        self._arrivals += 1
        self.stats["requests"] += 1
        self._work.set()
        try:
            return await job.future
        except asyncio.CancelledError:
            for row in rows:
                row.cancelled = True
            raise

    async def hold(self) -> None:
        """New and queued requests wait; returns once the batch in flight (if any) has finished."""
        self.stats["held"] = True
        self._released.clear()
        await self._idle.wait()

    def release(self) -> None:
        self.stats["held"] = False
        self._released.set()

    async def _gather(self) -> None:
        deadline = time.monotonic() + self.max_wait_s
        while len(self._pending) < self.max_batch_size and time.monotonic() < deadline:
            seen = self._arrivals
            await asyncio.sleep(self.quiet_s)
            if self._arrivals == seen:
                return

    def _pick(self) -> tuple[str, list[Row]]:
        """Rows for one batch: the oldest row's model, up to max_batch_size rows; fails unknown models."""
        chosen: str | None = None
        batch: list[Row] = []
        remaining: deque[Row] = deque()
        for row in self._pending:
            job = row.job
            if row.cancelled:
                self.stats["dropped_rows"] += 1
                continue
            if job.future.done():
                continue
            try:
                name = job.resolved or self.resolve(job.model)
            except Exception as error:
                job.future.set_exception(error)
                continue
            chosen = chosen or name
            if name == chosen and len(batch) < self.max_batch_size:
                job.resolved = name
                batch.append(row)
            else:
                remaining.append(row)
        self._pending = remaining
        return chosen or "", batch

    async def _loop(self) -> None:
        while True:
            await self._work.wait()
            await self._released.wait()
            await self._gather()
            if not self._released.is_set():
                continue
            model, batch = self._pick()
            if not self._pending:
                self._work.clear()
            if not batch:
                continue
            self._idle.clear()
            self.stats["running"] = 1
            try:
                await asyncio.to_thread(self.run_batch, model, batch)
            except Exception as error:
                for job in {id(r.job): r.job for r in batch}.values():
                    if not job.future.done():
                        job.future.set_exception(error)
            finally:
                self.stats["running"] = 0
                self.stats["batches"] += 1
                self.stats["rows"] += len(batch)
                self.stats["aborted_rows"] += sum(r.finish_reason == "abort" for r in batch)
                self._idle.set()
            for job in {id(r.job): r.job for r in batch}.values():
                if not job.future.done() and all(r.finish_reason for r in job.rows):
                    job.future.set_result(job.resolved)
