"""The HF engine's decoding loop: rows in, sampled tokens and their logprobs out.

Why a hand-written loop instead of `model.generate`: every row of a batch needs its own temperature, top_p,
max_tokens, stop strings, seed and output constraint (a choice trie or a JSON grammar, see hf/grammar.py),
and the engine must report the raw log-probability of every sampled token. Design choices:

- Prefill: left-padded rows, `position_ids` from the attention mask, a `DynamicCache`, and only the last
  position's logits (`logits_to_keep=1`), so the prompt never pays for a full-vocabulary projection; prompts of
  very different lengths are prefilled in separate chunks (`prefill_chunks`).
- Decoding, two ways: from the engine's slot buffers (`_SlotBatch`, hf/slots.py: fixed shapes, so a CUDA
  graph replays each step; the default wherever the model passes `check_slots`), or from a growing
  `DynamicCache` (`_Batch`: every model, sliding windows included).
- Continuous batching: finished rows leave the batch and queued rows of the same model join it between steps
  (their own prefill, then their keys and values moved into the batch), so neither a long straggler nor an
  agent's next turn waits for a whole batch to drain. Rows whose client went away (`Row.cancelled`, set from
  the event loop and read by the decoding thread at each step) leave with finish_reason "abort".
- Sampling is batched (hf/sampling.py): per-row settings as tensors, one host copy per step. Reported logprobs
  are the model's log-softmax at temperature 1, before the choice or grammar mask, temperature or top_p: that
  is what the trainer recomputes, and what vLLM reports by default. A seeded row's tokens depend only on its
  seed and its own logits, whatever else runs beside it or whenever it joined.
- A streamed row's `on_token` is called after each token it gains (and once when it finishes), so the server
  can send tokens as they are sampled; the callback only wakes the event loop, it never blocks decoding.
- Why not transformers' own continuous batching (`generate_batch`, paged attention): per-row sampling
  settings, raw logprobs, grammar masks, cancellation and adapter switching would all have to go through its
  request manager, and on an H100 it ran at 0.21-0.26x plain `generate` (benchmarks/gpu_check.py measures it
  beside this loop). The request scheduler is hf/scheduler.py.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, cast

import torch
from transformers import DynamicCache

from artnb.backends.engines.hf.grammar import JsonConstraint, mask_logits
from artnb.backends.engines.hf.sampling import Sampled, Settings, sample
from artnb.backends.engines.hf.slots import SlotDecoder, plain_layers, unsupported_reason

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


def _kv_layers(cache: DynamicCache) -> list[_KVLayer]:
    """The layers of a joinable cache (`plain_layers`), their keys and values set by the prefill; transformers
    types a layer as any kind, its keys as possibly None."""
    return cast("list[_KVLayer]", cache.layers)


@dataclass
class _Prefill:
    """One padded prefill pass over some rows: their cache (left-padded to a common width) and next logits."""

    cache: DynamicCache
    mask: torch.Tensor  # [B, width]
    next_pos: torch.Tensor  # [B]
    logits: torch.Tensor  # [B, V]


def _prefill(model: Any, rows: list[Row], pad_id: int) -> _Prefill:
    width = max(len(r.prompt_ids) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, width - len(row.prompt_ids) :] = torch.tensor(row.prompt_ids)
        mask[i, width - len(row.prompt_ids) :] = 1
    input_ids, mask = input_ids.to(model.device), mask.to(model.device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    out = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return _Prefill(cache, mask, positions[:, -1] + 1, out.logits[:, -1, :])


class _Rows:
    """The rows decoding together and what sampling needs of them: each row's place in its choice trie and
    stop-string tail, their settings as tensors, and their next logits. Subclasses keep the KV cache."""

    joinable = True  # rows may join between steps

    def __init__(self, model: Any, *, pad_id: int, eos_ids: list[int]):
        self.model, self.pad_id, self.eos_ids = model, pad_id, eos_ids
        self.device = model.device
        self.rows: list[Row] = []
        self.nodes: list[dict | None] = []  # each row's position in its choice trie
        self.tails: list[int] = []  # how many final tokens may hold a stop string
        self.logits: torch.Tensor | None = None  # [B, V]
        self.settings: Settings | None = None
        self.generator = torch.Generator(device=self.device).manual_seed(secrets.randbits(63))

    def add(self, rows: list[Row]) -> None:
        """Prefill `rows` and make them part of the batch (their logits ready for the next sample)."""
        raise NotImplementedError

    def keep(self, keep: list[int], tokens: torch.Tensor) -> None:
        """Keep rows `keep` (indices into self.rows) and feed each its sampled token (`tokens`, one per row, on
        the device): their next logits."""
        raise NotImplementedError

    def _append(self, rows: list[Row], logits: torch.Tensor) -> None:
        self.rows += rows
        self.nodes += [r.choices.root if r.choices else None for r in rows]
        # A stop string of c characters spans at most c tokens, plus a few for a character split into bytes.
        self.tails += [4 * max(map(len, r.stop)) + 4 if r.stop else 0 for r in rows]
        self.logits = logits if self.logits is None else torch.cat([self.logits, logits])
        self.settings = None

    def _select(self, order: list[int]) -> None:
        self.rows = [self.rows[j] for j in order]
        self.nodes = [self.nodes[j] for j in order]
        self.tails = [self.tails[j] for j in order]
        self.settings = None

    def _clear(self) -> None:
        self.rows, self.nodes, self.tails, self.settings, self.logits = [], [], [], None, None

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


class _Batch(_Rows):
    """Rows decoding from a growing `DynamicCache`, left-padded to a common width.

    Rows join (`add`: their own prefill, then their cache is merged in, the shorter side padded on the left and
    masked) and leave (`keep`) between steps; leading columns that no row still attends to are cropped, so a
    batch that runs for hours does not grow wider. Joining needs plain `DynamicLayer`s; a model with other
    cache layers (sliding windows) decodes each batch to the end instead.
    """

    def __init__(self, model: Any, *, pad_id: int, eos_ids: list[int]):
        super().__init__(model, pad_id=pad_id, eos_ids=eos_ids)
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # [B, L]; these two are set with the cache
        self.next_pos: torch.Tensor | None = None  # [B]
        self.joinable = plain_layers(DynamicCache(config=model.config))

    def add(self, rows: list[Row]) -> None:
        """Prefill `rows` and make them part of the batch (their logits ready for the next sample), in chunks
        of similar prompt lengths (`prefill_chunks`) where the model's cache can be merged."""
        for chunk in prefill_chunks(rows) if self.joinable else [rows]:
            self._add(chunk)

    def _add(self, rows: list[Row]) -> None:
        new = _prefill(self.model, rows, self.pad_id)
        if self.cache is None:
            self.cache, self.mask, self.next_pos = new.cache, new.mask, new.next_pos
        else:
            assert self.mask is not None and self.next_pos is not None
            old, width = self.mask.shape[1], new.mask.shape[1]
            total = max(old, width)
            for mine, theirs in zip(_kv_layers(self.cache), _kv_layers(new.cache), strict=True):
                mine.keys = torch.cat(
                    [_left_pad(mine.keys, total - old, -2), _left_pad(theirs.keys, total - width, -2)]
                )
                mine.values = torch.cat(
                    [_left_pad(mine.values, total - old, -2), _left_pad(theirs.values, total - width, -2)]
                )
            self.mask = torch.cat(
                [_left_pad(self.mask, total - old, -1), _left_pad(new.mask, total - width, -1)]
            )
            self.next_pos = torch.cat([self.next_pos, new.next_pos])
        self._append(rows, new.logits)

    def keep(self, keep: list[int], tokens: torch.Tensor) -> None:
        if not keep:
            self._clear()
            self.cache = self.mask = self.next_pos = None
            return
        assert self.cache is not None and self.mask is not None and self.next_pos is not None
        if len(keep) < len(self.rows):
            index = torch.tensor(keep, device=self.device)
            tokens = tokens[index]
            self.cache.batch_select_indices(index)
            self.mask, self.next_pos = self.mask[index], self.next_pos[index]
            self._select(keep)
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


class _SlotBatch(_Rows):
    """Rows decoding from an engine's slot buffers (hf/slots.py): row j in slot j, each at its own column.

    A joining row's prompt is prefilled as in `_Batch` (chunks of similar lengths, padded) and its keys and
    values copied into a free slot; rows that leave give their slots to the last rows. The buffers grow before
    a step that needs more slots or columns.
    """

    def __init__(self, model: Any, slots: SlotDecoder, *, pad_id: int, eos_ids: list[int]):
        super().__init__(model, pad_id=pad_id, eos_ids=eos_ids)
        self.slots = slots

    def add(self, rows: list[Row]) -> None:
        for chunk in prefill_chunks(rows):
            new = _prefill(self.model, chunk, self.pad_id)
            first = len(self.rows)
            self._reserve(self.rows + chunk)
            layers = _kv_layers(new.cache)
            for i, row in enumerate(chunk):
                self.slots.load(first + i, layers, i, len(row.prompt_ids))
            self._append(chunk, new.logits)

    def keep(self, keep: list[int], tokens: torch.Tensor) -> None:
        if not keep:
            self._clear()
            return
        if len(keep) < len(self.rows):
            n, kept = len(keep), set(keep)
            holes = [j for j in range(n) if j not in kept]
            movers = [j for j in keep if j >= n]
            order = list(range(n))
            for hole, mover in zip(holes, movers, strict=True):
                order[hole] = mover
            if holes:
                self.slots.move(holes, movers)
            tokens = tokens[torch.tensor(order, device=self.device)]
            self._select(order)
        self._reserve(self.rows)
        width = max(len(r.prompt_ids) + len(r.token_ids) for r in self.rows)  # the fed tokens' positions + 1
        self.logits = self.slots.step(len(self.rows), tokens, width)

    def _reserve(self, rows: list[Row]) -> None:
        """Room for `rows` (those already in slots first), the column each writes next and the one after it
        (a step moves every position on, clamped to the last column)."""
        self.slots.reserve(
            len(rows),
            columns=max(len(r.prompt_ids) + max(len(r.token_ids), 1) + 1 for r in rows),
            most_columns=max(len(r.prompt_ids) + r.max_tokens for r in rows),
        )


# The largest difference of any token's logprob between slot and dynamic-cache decoding that check_slots accepts,
# by dtype: fp32 agrees to ~4e-5 on the embedded model; 16-bit floats keep 8 or 11 bits of each sum, and the two
# attend over different widths. A real fault is far larger: on the embedded model (fp32) a position off by one
# moved logprobs by 2.2, one prompt column masked out by 18.
SLOT_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
SLOT_TOLERANCE_16BIT = 0.5


@dataclass
class SlotCheck:
    """What `check_slots` found: why the model must not decode from slots (None: it may), and the largest
    logprob difference it measured against the dynamic cache."""

    problem: str | None
    difference: float = math.nan


@torch.inference_mode()
def check_slots(model: Any, slots: SlotDecoder, *, pad_id: int, eos_ids: list[int]) -> SlotCheck:
    """Whether `model` may decode from `slots`: its config (`unsupported_reason`), then the same greedy steps
    from the slots and from a dynamic cache, with a row joining, a row leaving and replayed CUDA graphs among
    them, whose logprobs must agree within SLOT_TOLERANCE. Frees the slots."""
    if (reason := unsupported_reason(model)) is not None:
        return SlotCheck(reason)
    vocab = model.get_output_embeddings().weight.shape[0]
    prompts = [[(101 + 7 * i + 13 * k) % vocab for k in range(3 + 5 * i)] for i in range(3)]
    dtype = next(model.parameters()).dtype
    tolerance = SLOT_TOLERANCE.get(dtype, SLOT_TOLERANCE_16BIT)
    slots.begin(model, key=("check",))
    try:
        dynamic = _Batch(model, pad_id=pad_id, eos_ids=eos_ids)
        slotted = _SlotBatch(model, slots, pad_id=pad_id, eos_ids=eos_ids)
        worst = 0.0
        joining = {0: prompts[:2], 3: prompts[2:]}
        for step in range(8):  # rows: 2 (a bucket's first step, eager), 2 (replayed), 2, 3, 3, 2, 2, 2
            for batch in (dynamic, slotted):
                if step in joining:
                    batch.add([Row(p, max_tokens=16, temperature=0.0) for p in joining[step]])
            assert dynamic.logits is not None and slotted.logits is not None
            expected = torch.log_softmax(dynamic.logits.float(), dim=-1)
            worst = max(
                worst, float((expected - torch.log_softmax(slotted.logits.float(), dim=-1)).abs().max())
            )
            tokens = dynamic.logits.argmax(dim=-1)  # both sides are fed the same tokens
            keep = [j for j in range(len(dynamic.rows)) if not (step == 5 and j == 1)]
            for batch in (dynamic, slotted):
                for row, token in zip(batch.rows, tokens.tolist(), strict=True):
                    row.token_ids.append(token)
                batch.keep(keep, tokens)
    except Exception as error:  # a model whose forward pass does not fit the slots
        return SlotCheck(f"decoding from the slots failed ({type(error).__name__}: {error})")
    finally:
        slots.release()
    if worst > tolerance:
        return SlotCheck(
            f"its logprobs from the slots differed from the dynamic cache's by {worst:.3g} "
            f"(more than {tolerance:g} for {dtype})",
            worst,
        )
    return SlotCheck(None, worst)


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
    slots: SlotDecoder | None = None,
) -> None:
    """Sample every row to completion in one decoding loop, filling token_ids, logprobs and finish_reason.

    Between steps, `more(n)` may hand over up to n new rows (n keeps the batch within `max_rows`): they join the
    running batch and the loop runs until no row is left. `on_finish(row)` is called as each row finishes.
    `eos_ids[0]` is the token a choice constraint forces once a choice is complete. With `slots` (begun on
    this model: `SlotDecoder.begin`) the rows decode from its slot buffers, else from a dynamic cache.
    """
    batch: _Rows = (
        _Batch(model, pad_id=pad_id, eos_ids=eos_ids)
        if slots is None
        else _SlotBatch(model, slots, pad_id=pad_id, eos_ids=eos_ids)
    )
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
