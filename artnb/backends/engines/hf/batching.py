"""The HF engine's decoding loop and request scheduler.

Why a hand-written loop instead of `model.generate`: every row of a batch needs its own temperature, top_p,
max_tokens, stop strings, seed and output constraint (a choice trie or a JSON grammar, see hf/grammar.py),
and the engine must report the raw log-probability of every sampled token. Design choices:

- Left-padded batch, `position_ids` from the attention mask, a `DynamicCache`, and a prefill that keeps only
  the last position's logits (`logits_to_keep=1`), so the prompt never pays for a full-vocabulary projection.
- Continuous batching: finished rows leave the batch (the KV cache is re-indexed) and queued rows of the same
  model join it between steps (their own prefill, then their cache merged in, left-padded), so neither a
  long straggler nor an agent's next turn waits for a whole batch to drain. A request is answered as soon as
  its own rows end. Rows whose client went away (`Row.cancelled`, set from the event loop and read by the
  decoding thread at each step) leave with finish_reason "abort"; their queued rows never run.
- Sampling is batched (hf/sampling.py): per-row settings as tensors, one host copy per step. Reported logprobs
  are the model's log-softmax at temperature 1, before the choice or grammar mask, temperature or top_p: that
  is what the trainer recomputes, and what vLLM reports by default. A seeded row's tokens depend only on its
  seed and its own logits, whatever else runs beside it or whenever it joined.
- A streamed row's `on_token` is called after each token it gains (and once when it finishes), so the server
  can send tokens as they are sampled; the callback only wakes the event loop, it never blocks decoding.
- The scheduler batches requests that arrive within a few milliseconds of each other, runs one adapter's
  rows per batch in a worker thread, and resolves model names only when rows are scheduled, so a request
  queued during `hold` runs on the adapter loaded before `release` (no row joins a batch while held).
- Why not transformers' own continuous batching (`generate_batch`, paged attention) or a static cache with
  CUDA graphs: per-row sampling settings, raw logprobs, grammar masks, cancellation and adapter switching
  would all have to go through its request manager; `benchmarks/gpu_check.py` measures it beside this loop.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from artnb.backends.engines.hf.grammar import JsonConstraint, mask_logits
from artnb.backends.engines.hf.sampling import Sampled, Settings, sample

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
    on_token: Callable[[], object] | None = (
        None  # called on the decoding thread after each token and at the end
    )
    job: Any = None  # the scheduler's handle on the request this row belongs to
    cancelled: bool = False  # the client went away: leave the batch at the next step (finish_reason "abort")
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None


def _hit_stop(row: Row, decode: Callable[[list[int]], str], tail_tokens: int) -> bool:
    text = decode(row.token_ids[-tail_tokens:])
    return any(s in text for s in row.stop)


def _notify(row: Row) -> None:
    if row.on_token is not None:
        row.on_token()


def _left_pad(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """`tensor` with `width` zeros prepended along `dim`."""
    if width == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = width
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


# A prefill pass pads its rows to the longest prompt, and its attention costs rows x width^2: one long prompt among
# short ones made every row as costly as the long one (31 short rows + one of 1734 tokens: 250 s and 4 GB on this
# CPU, against 19 s and 0.6 GB prefilled apart). Rows are therefore prefilled in chunks whose longest prompt is at
# most PREFILL_SPREAD times the shortest (prompts up to PREFILL_SHORT tokens always go together: padding them costs
# little) and whose padded width x rows stays under PREFILL_TOKENS (one row at least).
PREFILL_SPREAD = 2
PREFILL_SHORT = 256
PREFILL_TOKENS = 8192


def prefill_chunks(rows: list[Row]) -> list[list[Row]]:
    """`rows` sorted by prompt length and cut into chunks to prefill one at a time (see PREFILL_SPREAD)."""
    chunks: list[list[Row]] = []
    for row in sorted(rows, key=lambda r: len(r.prompt_ids)):
        n = len(row.prompt_ids)
        chunk = chunks[-1] if chunks else None
        if (
            chunk is None
            or n > max(PREFILL_SPREAD * len(chunk[0].prompt_ids), PREFILL_SHORT)
            or n * (len(chunk) + 1) > PREFILL_TOKENS
        ):
            chunks.append([row])
        else:
            chunk.append(row)
    return chunks


class _KVLayer(Protocol):
    keys: torch.Tensor
    values: torch.Tensor


def _plain_layers(cache: DynamicCache) -> bool:
    """Whether every layer of `cache` is a plain DynamicLayer, whose keys and values rows can be merged into
    (sliding-window layers cannot)."""
    return all(type(layer) is DynamicLayer for layer in cache.layers)


def _kv_layers(cache: DynamicCache) -> list[_KVLayer]:
    """The layers of a joinable cache (`_Batch.joinable`: plain DynamicLayers), their keys and values set by
    the prefill; transformers types a layer as any kind, its keys as possibly None."""
    return cast("list[_KVLayer]", cache.layers)


class _Batch:
    """The rows decoding together: their KV cache, attention mask, next positions and last logits.

    Rows are left-padded to a common width. Rows join (`add`: their own prefill, then their cache is merged in,
    the shorter side padded on the left and masked) and leave (`keep`) between steps; leading columns that no
    row still attends to are cropped, so a batch that runs for hours does not grow wider. Joining needs plain
    `DynamicLayer`s; a model with other cache layers (sliding windows) decodes each batch to the end instead.
    """

    def __init__(self, model: Any, *, pad_id: int, eos_ids: list[int]):
        self.model, self.pad_id, self.eos_ids = model, pad_id, eos_ids
        self.device = model.device
        self.rows: list[Row] = []
        self.nodes: list[dict | None] = []  # each row's position in its choice trie
        self.tails: list[int] = []  # how many final tokens may hold a stop string
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # [B, L]; these three are set with the cache
        self.next_pos: torch.Tensor | None = None  # [B]
        self.logits: torch.Tensor | None = None  # [B, V]
        self.settings: Settings | None = None
        self.generator = torch.Generator(device=self.device).manual_seed(secrets.randbits(63))

    @property
    def joinable(self) -> bool:
        return _plain_layers(self.cache or DynamicCache(config=self.model.config))

    def add(self, rows: list[Row]) -> None:
        """Prefill `rows` and make them part of the batch (their logits ready for the next sample), in chunks
        of similar prompt lengths (`prefill_chunks`) where the model's cache can be merged."""
        for chunk in prefill_chunks(rows) if self.joinable else [rows]:
            self._add(chunk)

    def _add(self, rows: list[Row]) -> None:
        width = max(len(r.prompt_ids) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, width - len(row.prompt_ids) :] = torch.tensor(row.prompt_ids)
            mask[i, width - len(row.prompt_ids) :] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits, next_pos = out.logits[:, -1, :], positions[:, -1] + 1
        self.rows += rows
        self.nodes += [r.choices.root if r.choices else None for r in rows]
        # A stop string of c characters spans at most c tokens, plus a few for a character split into bytes.
        self.tails += [4 * max(map(len, r.stop)) + 4 if r.stop else 0 for r in rows]
        if self.cache is None:
            self.cache, self.mask, self.next_pos, self.logits = cache, mask, next_pos, logits
        else:
            assert self.mask is not None and self.next_pos is not None and self.logits is not None
            old, new = self.mask.shape[1], mask.shape[1]
            total = max(old, new)
            for mine, theirs in zip(_kv_layers(self.cache), _kv_layers(cache), strict=True):
                mine.keys = torch.cat(
                    [_left_pad(mine.keys, total - old, -2), _left_pad(theirs.keys, total - new, -2)]
                )
                mine.values = torch.cat(
                    [_left_pad(mine.values, total - old, -2), _left_pad(theirs.values, total - new, -2)]
                )
            self.mask = torch.cat([_left_pad(self.mask, total - old, -1), _left_pad(mask, total - new, -1)])
            self.next_pos = torch.cat([self.next_pos, next_pos])
            self.logits = torch.cat([self.logits, logits])
        self.settings = None

    def sample(self) -> Sampled:
        assert self.logits is not None, "sample() needs rows in the batch"
        if self.settings is None:
            self.settings = Settings.of(self.rows, self.device)
        return sample(self.logits, self.rows, self.settings, self._masks(), self.generator)

    def _masks(self) -> list[Callable[[torch.Tensor], None]]:
        masks: list[Callable[[torch.Tensor], None]] = []
        no_eos: list[int] = []  # rows below their min_tokens: one masking operation for all of them
        for j, (row, node) in enumerate(zip(self.rows, self.nodes, strict=True)):
            if node is not None:
                masks.append(partial(_mask_choice, j=j, allowed=ChoiceTrie.allowed(node, self.eos_ids[0])))
            elif len(row.token_ids) < row.min_tokens and row.grammar is None:
                no_eos.append(j)
            if row.token_ids and (row.presence_penalty or row.frequency_penalty):
                masks.append(partial(_penalise, j=j, row=row))
        if no_eos:
            masks.append(partial(_mask_tokens, rows=no_eos, tokens=self.eos_ids))
        if any(row.grammar is not None for row in self.rows):
            masks.append(lambda logits: mask_logits(logits, [row.grammar for row in self.rows]))
        return masks

    def keep(self, keep: list[int], tokens: torch.Tensor) -> None:
        """Keep rows `keep` (indices into self.rows) and feed each its sampled token (`tokens`, one per row, on
        the device): their next logits."""
        if not keep:
            self.rows, self.nodes, self.tails, self.settings = [], [], [], None
            self.cache = self.mask = self.next_pos = self.logits = None
            return
        assert self.cache is not None and self.mask is not None and self.next_pos is not None
        if len(keep) < len(self.rows):
            index = torch.tensor(keep, device=self.device)
            tokens = tokens[index]
            self.cache.batch_select_indices(index)
            self.mask, self.next_pos = self.mask[index], self.next_pos[index]
            self.rows = [self.rows[j] for j in keep]
            self.nodes = [self.nodes[j] for j in keep]
            self.tails = [self.tails[j] for j in keep]
            self.settings = None
            if self.joinable:
                self._crop()
        self.mask = torch.cat([self.mask, self.mask.new_ones((len(keep), 1))], dim=-1)
        out = self.model(
            input_ids=tokens[:, None],
            attention_mask=self.mask,
            position_ids=self.next_pos[:, None],
            past_key_values=self.cache,
            use_cache=True,
        )
        self.logits = out.logits[:, -1, :]
        self.next_pos = self.next_pos + 1

    def _crop(self) -> None:
        """Drop the leading columns no remaining row attends to (left by rows that left)."""
        assert self.cache is not None and self.mask is not None
        lead = int(self.mask.any(0).int().argmax())
        if lead > 0:
            for layer in _kv_layers(self.cache):
                layer.keys, layer.values = layer.keys[:, :, lead:], layer.values[:, :, lead:]
            self.mask = self.mask[:, lead:]


def _mask_choice(logits: torch.Tensor, *, j: int, allowed: list[int]) -> None:
    index = torch.tensor(allowed, device=logits.device)
    masked = torch.full_like(logits[j], float("-inf"))
    masked[index] = logits[j, index]
    logits[j] = masked


def _mask_tokens(logits: torch.Tensor, *, rows: list[int], tokens: list[int]) -> None:
    index = (
        torch.tensor(rows, device=logits.device)[:, None],
        torch.tensor(tokens, device=logits.device)[None, :],
    )
    logits[index] = float("-inf")


def _penalise(logits: torch.Tensor, *, j: int, row: Row) -> None:
    counts = torch.bincount(torch.tensor(row.token_ids), minlength=logits.shape[-1]).to(logits.device)
    logits[j] -= row.presence_penalty * (counts > 0) + row.frequency_penalty * counts


@torch.inference_mode()
def decode_batch(
    model: Any,
    rows: list[Row],
    *,
    pad_id: int,
    eos_ids: list[int],
    decode: Callable[[list[int]], str],
    more: Callable[[int], list[Row]] | None = None,
    max_rows: int = 0,
    on_finish: Callable[[Row], None] | None = None,
) -> None:
    """Sample every row to completion in one decoding loop, filling token_ids, logprobs and finish_reason.

    Between steps, `more(n)` may hand over up to n new rows (n keeps the batch within `max_rows`): they join the
    running batch and the loop runs until no row is left. `on_finish(row)` is called as each row finishes.
    `eos_ids[0]` is the token a choice constraint forces once a choice is complete.
    """
    batch = _Batch(model, pad_id=pad_id, eos_ids=eos_ids)
    batch.add(rows)
    while batch.rows:
        sampled = batch.sample()
        keep: list[int] = []
        for j, row in enumerate(batch.rows):
            token = sampled.tokens[j]
            if row.cancelled:
                row.finish_reason = "abort"
            else:
                row.token_ids.append(token)
                row.logprobs.append(sampled.logprobs[j])
                row.top.append(sampled.top[j])
                if (node := batch.nodes[j]) is not None:
                    batch.nodes[j] = node.get(token, {})
                if row.grammar is not None:
                    row.grammar.accept(token)
                if token in eos_ids or (row.stop and _hit_stop(row, decode, batch.tails[j])):
                    row.finish_reason = "stop"
                elif len(row.token_ids) >= row.max_tokens:
                    row.finish_reason = "length"
                else:
                    keep.append(j)
            _notify(row)
            if row.finish_reason is not None and on_finish is not None:
                on_finish(row)
        batch.keep(keep, sampled.ids)
        if more is not None and batch.joinable and (room := max_rows - len(batch.rows)) > 0:
            joining = more(room)
            if joining:
                batch.add(joining)


@dataclass
class _Job:
    model: str
    rows: list[Row]
    future: asyncio.Future
    resolved: str | None = None  # the model name the rows ran on, fixed when the first rows are scheduled


class Scheduler:
    """Queues requests, batches them, and runs each batch in a worker thread; supports hold/release.

    `resolve(name)` maps a requested model name to the name that serves it (raising for unknown names);
    `run_batch(resolved_name, rows, more, on_finish)` decodes the rows (blocking; it runs in a worker thread),
    calling `more(n)` between steps for up to n queued rows of the same model to join the running batch, and
    `on_finish(row)` as each row ends, so that a request is answered as soon as its own rows are done.
    """

    def __init__(
        self,
        resolve: Callable[[str], str],
        run_batch: Callable[[str, list[Row], Callable[[int], list[Row]], Callable[[Row], None]], None],
        max_batch_size: int,
        quiet_s: float = 0.01,  # a batch forms once no request arrived for this long...
        max_wait_s: float = 0.05,  # ...or after this long, whichever comes first
    ):
        self.resolve, self.run_batch, self.max_batch_size = resolve, run_batch, max_batch_size
        self.quiet_s, self.max_wait_s = quiet_s, max_wait_s
        self._pending: deque[Row] = deque()
        self._lock = threading.Lock()  # _pending is also read by the decoding thread (rows joining)
        self._arrivals = 0
        self._work = asyncio.Event()
        self._released = asyncio.Event()
        self._released.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stats = {
            "requests": 0,
            "rows": 0,  # rows decoded (aborted ones included)
            "batches": 0,
            "joined_rows": 0,  # rows that joined a batch already decoding
            "running": 0,
            "held": False,
            "aborted_rows": 0,  # left a running batch because their client disconnected
            "dropped_rows": 0,  # removed from the queue before running, because their client disconnected
        }
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._loop_forever())

    async def submit(self, model: str, rows: list[Row]) -> str:
        """Queue rows for `model`; return the model name they ran on once all are finished.

        Cancelling the caller (its client went away) cancels the rows: queued ones are dropped, running ones
        leave their batch at the next decoding step.
        """
        job = _Job(model, rows, asyncio.get_running_loop().create_future())
        for row in rows:
            row.job = job
        with self._lock:
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

    def _pick(self, model: str | None, limit: int) -> tuple[str, list[Row]]:
        """Up to `limit` queued rows of `model` (None: the oldest live row's model); fails unknown models.

        Runs on the event loop (a new batch) or the decoding thread (rows joining), under the queue's lock.
        Joining stops at the first queued row of another model, so that the batch drains and that model's rows
        run next instead of waiting behind a stream of newer rows.
        """
        chosen = model
        batch: list[Row] = []
        remaining: deque[Row] = deque()
        blocked = False
        with self._lock:
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
                    self._call(_fail, job, error)
                    continue
                chosen = chosen or name
                blocked = blocked or (model is not None and name != model)
                if name == chosen and len(batch) < limit and not blocked:
                    job.resolved = name
                    batch.append(row)
                else:
                    remaining.append(row)
            self._pending = remaining
        return chosen or "", batch

    def _join(self, model: str, batch: list[Row], limit: int) -> list[Row]:
        """Rows to join the running batch of `model` (the decoding thread asks between steps)."""
        if not self._pending or not self._released.is_set():
            return []
        _, rows = self._pick(model, limit)
        batch += rows
        self.stats["joined_rows"] += len(rows)
        return rows

    def _finished(self, row: Row) -> None:
        """A row ended (on the decoding thread): answer its request if that was its last row."""
        job = row.job
        if job is not None and all(r.finish_reason for r in job.rows):
            self._call(_complete, job)

    def _call(self, function: Callable[..., None], *args: Any) -> None:
        """Run `function` on the event loop (futures are not thread-safe), from either thread."""
        assert self._loop is not None, "Scheduler.start() first"
        self._loop.call_soon_threadsafe(function, *args)

    async def _loop_forever(self) -> None:
        while True:
            await self._work.wait()
            await self._released.wait()
            await self._gather()
            if not self._released.is_set():
                continue
            model, batch = self._pick(None, self.max_batch_size)
            if not self._pending:
                self._work.clear()
            if not batch:
                continue
            self._idle.clear()
            self.stats["running"] = 1
            more = partial(self._join, model, batch)
            try:
                await asyncio.to_thread(self.run_batch, model, batch, more, self._finished)
            except Exception as error:
                for job in {id(r.job): r.job for r in batch}.values():
                    _fail(job, error)
            finally:
                self.stats["running"] = 0
                self.stats["batches"] += 1
                self.stats["rows"] += len(batch)
                self.stats["aborted_rows"] += sum(r.finish_reason == "abort" for r in batch)
                self._idle.set()
            for job in {id(r.job): r.job for r in batch}.values():
                if all(r.finish_reason for r in job.rows):
                    _complete(job)
            if self._pending:
                self._work.set()


def _complete(job: _Job) -> None:
    if not job.future.done():
        job.future.set_result(job.resolved)


def _fail(job: _Job, error: BaseException) -> None:
    if not job.future.done():
        job.future.set_exception(error)
