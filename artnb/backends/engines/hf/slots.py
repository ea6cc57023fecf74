"""Decoding from KV buffers of fixed slots: every decode step has the same shapes and the same addresses, which
is what a CUDA graph needs to replay the step instead of launching its hundreds of kernels one by one.

Why (issue 25): on a GPU a decode step of a small model is launch-bound. Decoding from a growing
`DynamicCache`, the HF engine ran at 0.81-0.94x a plain `generate` on an H100 (both ~30 ms a step for a 1.5B
model), and every step also copied each layer's whole cache (`torch.cat`) to append one column. Chosen over
transformers' own answers: its static cache with `torch.compile` shares one write column across the batch
(rows joining mid-batch would have to be left-padded into it) and compiles for each batch size; its continuous
batching ran at 0.21-0.26x `generate` on the same H100. Design choices:

- One buffer per kind for all layers: keys and values `[layers, slots, kv_heads, columns, head_dim]`, a boolean
  attention mask `[slots, columns]`, each slot's next position and its input token. A row owns one slot; its
  prompt's keys and values (from the usual padded prefill, hf/batching.py) are copied to the slot's first
  columns, so a row's column is its position: no left padding, and each row writes its new key and value at
  its own column (`scatter_`).
- Rows that finish give their slot to the last live row (one copy per buffer for all layers), so live rows are
  always slots `0..n-1`. On CUDA a step runs the first `bucket(n)` slots over all columns: a power of two, so a
  graph captured once per bucket serves every batch size (spare slots compute garbage nobody reads). On a CPU,
  where nothing is captured, a step reads only the `n` live rows and the columns in use.
- The buffers grow (slots in powers of two, columns by doubling towards what the rows may need) and are
  re-allocated only then; rows keep their contents. They stay from batch to batch (an RL loop's batches are
  alike, so allocating and zeroing them again for each would be work for nothing); a hold for training frees
  them, and the next batch allocates them at the largest size they had, at once.
- A prefill is copied row by row, layer by layer, from the prefill's cache into the row's slot: one copy of
  each prompt's keys and values.
- Attention: for a one-token query, the query heads that share a key/value head are laid out as that head's
  queries (`[B, kv_heads, group, head_dim]`), so scaled-dot-product attention reads each key and value once;
  transformers' SDPA path with a mask repeats them `group` times (6x for Qwen2.5-1.5B) at every step.
- CUDA graphs (`StepGraphs`): a bucket's first step runs eagerly (its warm-up, and its real result), the next
  ones replay a graph captured right after. Graphs are dropped whenever the buffers move or the model being
  served changes (another adapter, merged or not: `SlotDecoder.begin`'s key), and with the buffers when the
  engine is held for training. A capture that fails turns graphs off for this engine, with one line in its log;
  decoding goes on eagerly from the same slots.
- Which models: those whose cache layers are plain full-attention layers (sliding windows and attention
  soft-capping need their own masks) and that pass `check_slots` (hf/batching.py) at engine start: greedy steps
  from the slots and from the dynamic cache, rows joining and leaving, graphs replayed on CUDA, the same logprobs
  within the dtype's rounding. Every other model decodes from the dynamic cache, and the engine's log says why.

Measured on a 2-core CPU, against the dynamic cache (README "Engines"): the decoding loop alone 1.03-1.08x
(benchmarks/slot_decoding.py), the engine with 659-token prompts 1.59x `generate` where the dynamic cache made
1.13x (its per-step copies grow with the context; benchmarks/engine_batching.py --history 600). On a GPU:
measured by `benchmarks/gpu_check.py --only rollouts` (the slots with and without graphs, the dynamic cache and
`generate`), not yet run on one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from transformers import Cache, DynamicCache
from transformers.cache_utils import CacheLayerMixin, DynamicLayer
from transformers.modeling_utils import AttentionInterface

ATTENTION = "artnb_slots"  # the attention implementation slot steps run with (registered below)
COLUMN_STEP = 256  # columns are allocated in multiples of this


def bucket(rows: int) -> int:
    """The slots a step over `rows` live rows runs: the next power of two."""
    return 1 << max(0, rows - 1).bit_length()


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


def slot_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """One query token per row against its slot: query [B, H, 1, D], key/value [B, KV, C, D], mask [B, 1, 1, C]
    (bool). Grouped-query heads attend as one key/value head's queries, so the cache is read once."""
    rows, heads, length, dim = query.shape
    assert length == 1, "slot steps decode one token per row"
    groups = key.shape[1]
    grouped = query.reshape(rows, groups, heads // groups, dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped, key, value, attn_mask=attention_mask, scale=scaling
    )
    return out.reshape(rows, 1, heads, dim), None


AttentionInterface.register(ATTENTION, slot_attention)


class _SlotLayer(CacheLayerMixin):
    """One layer's view of the slot buffers: writes each row's new key and value at the row's own column."""

    is_sliding = False
    is_compileable = True

    def __init__(self, cache: SlotCache, index: int):
        super().__init__()
        self.cache, self.index = cache, index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # the buffers exist before any step

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.write(self.index, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.columns, 0

    def get_seq_length(self) -> int:
        return self.cache.columns

    def get_max_length(self) -> int:
        return self.cache.columns


class SlotCache(Cache):
    """The buffers, as the `Cache` a model's forward pass writes into: `rows` slots take part in a step."""

    def __init__(self, layers: int, slots: int, heads: int, columns: int, dim: int, *, dtype, device):
        super().__init__(layers=[_SlotLayer(self, i) for i in range(layers)])
        shape = (layers, slots, heads, columns, dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.mask = torch.zeros((slots, columns), dtype=torch.bool, device=device)
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)  # where each slot writes next
        self.tokens = torch.zeros(slots, dtype=torch.long, device=device)  # each slot's next input
        self.slots, self.columns = slots, columns
        self.width = columns  # the columns a step reads, from the first

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, heads, _, dim = key.shape
        index = self.positions[:rows].view(rows, 1, 1, 1).expand(rows, heads, 1, dim)
        keys, values = self.keys[layer, :rows], self.values[layer, :rows]
        keys.scatter_(2, index, key)
        values.scatter_(2, index, value)
        return keys[:, :, : self.width], values[:, :, : self.width]


class StepGraphs:
    """CUDA graphs of the decode step, one per bucket, valid while the buffers and the served model stay."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}  # bucket -> (graph, its logits output)
        self.captures = 0  # graphs captured so far (for the engine's stats)
        self.disabled_why: str | None = None

    def drop(self) -> None:
        self.graphs.clear()

    def run(self, rows: int, step: Any) -> torch.Tensor:
        """`step()`'s logits for a bucket of `rows` slots: a replay where captured; else run eagerly (then
        captured for the next time, on CUDA)."""
        found = self.graphs.get(rows)
        if found is not None:
            graph, logits = found
            graph.replay()
            return logits
        logits = step()
        if self.enabled:
            self._capture(rows, step)
        return logits

    def _capture(self, rows: int, step: Any) -> None:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                logits = step()
        except Exception as error:  # an operation the capture cannot record: decode eagerly from now on
            self.enabled, self.graphs = False, {}
            self.disabled_why = f"{type(error).__name__}: {error}"
            print(f"artnb engine: CUDA graphs off, decoding eagerly ({self.disabled_why})", flush=True)
            return
        self.graphs[rows] = (graph, logits)
        self.captures += 1


class SlotDecoder:
    """The slot buffers of one engine and the graphs over them; the decoding thread's alone.

    `begin(model, key)` starts a batch on `model`, `key` naming what it serves (another key drops the graphs);
    `reserve`, `load`, `move` and `step` are what a batch of rows (hf/batching.py `_SlotBatch`) does with them.
    The buffers stay for the next batch; `release()` gives the memory back (the engine is held for training).
    """

    def __init__(self, model: Any, *, graphs: bool | None = None):
        config = _config(model).get_text_config(decoder=True)
        self.layers = config.num_hidden_layers
        self.heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.device = model.device
        self.dtype = next(model.parameters()).dtype
        on_cuda = self.device.type == "cuda"
        self.graphs = StepGraphs(on_cuda if graphs is None else graphs and on_cuda)
        self.cache: SlotCache | None = None
        self.model: Any = None
        self.key: Any = None
        self.allocations = 0  # buffers allocated so far (each growth is one)
        self.largest = (1, 0)  # the most slots and columns the buffers had: their size after a release

    def begin(self, model: Any, key: Any) -> None:
        if model is not self.model or key != self.key:
            self.graphs.drop()
        self.model, self.key = model, key

    def release(self) -> None:
        self.graphs.drop()
        self.cache = None
        self.model = self.key = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # for the trainer, which is another process

    def reserve(self, rows: int, columns: int, most_columns: int) -> None:
        """Make room for `rows` live rows and `columns` columns (growing towards `most_columns`, what the rows
        may need at most), keeping the live rows' contents. `rows` counts the rows already in the slots."""
        cache = self.cache
        slots = max(bucket(rows), cache.slots if cache else self.largest[0])
        width = cache.columns if cache else self.largest[1]
        if cache is not None and slots == cache.slots and columns <= width:
            return
        if columns > width:
            width = max(columns, min(2 * width, most_columns), COLUMN_STEP)
            width = _round_up(width, COLUMN_STEP)
        new = SlotCache(self.layers, slots, self.heads, width, self.dim, dtype=self.dtype, device=self.device)
        if cache is not None:
            n, c = min(cache.slots, rows), cache.columns
            new.keys[:, :n, :, :c] = cache.keys[:, :n]
            new.values[:, :n, :, :c] = cache.values[:, :n]
            new.mask[:n, :c] = cache.mask[:n]
            new.positions[:n] = cache.positions[:n]
            new.tokens[:n] = cache.tokens[:n]
        self.cache = None  # the old buffers go before the graphs that hold them
        self.graphs.drop()
        self.cache = new
        self.allocations += 1
        self.largest = (max(self.largest[0], slots), max(self.largest[1], width))

    def load(self, slot: int, layers: Sequence[Any], row: int, length: int) -> None:
        """Put row `row` of a prefill in `slot`: `layers` are the prefill cache's layers (keys and values
        [rows, kv_heads, width, head_dim], left-padded), the last `length` columns the row's prompt."""
        cache = self._cache()
        for index, layer in enumerate(layers):
            start = layer.keys.shape[2] - length
            cache.keys[index, slot, :, :length] = layer.keys[row, :, start:]
            cache.values[index, slot, :, :length] = layer.values[row, :, start:]
        cache.mask[slot] = False
        cache.mask[slot, :length] = True
        cache.positions[slot] = length

    def move(self, to: list[int], source: list[int]) -> None:
        """Slots `source` take the places of slots `to` (rows that left), pair by pair."""
        cache = self._cache()
        into = torch.tensor(to, device=self.device)
        take = torch.tensor(source, device=self.device)
        for buffer, dim in ((cache.keys, 1), (cache.values, 1), (cache.mask, 0), (cache.positions, 0)):
            buffer.index_copy_(dim, into, buffer.index_select(dim, take))

    def step(self, rows: int, tokens: torch.Tensor, width: int) -> torch.Tensor:
        """Feed `tokens` (one per live row, on the device) to slots 0..rows-1, whose positions are all below
        `width`; their next logits [rows, V]. On CUDA every step of a bucket has the same shapes (the whole
        buffers), with graphs or without; on a CPU a step reads only the live rows and columns."""
        cache = self._cache()
        cache.tokens[:rows] = tokens
        if self.device.type == "cuda":
            size, cache.width = bucket(rows), cache.columns
        else:
            size, cache.width = rows, width
        return self.graphs.run(size, lambda: self._forward(size))[:rows]

    def _forward(self, rows: int) -> torch.Tensor:
        cache = self._cache()
        positions = cache.positions[:rows]
        cache.mask[:rows].scatter_(1, positions[:, None], True)
        with _attention(self.model, ATTENTION):
            out = self.model(
                input_ids=cache.tokens[:rows, None],
                attention_mask=cache.mask[:rows, None, None, : cache.width],
                position_ids=positions[:, None],
                past_key_values=cache,
                use_cache=True,
            )
        # Spare slots of a bucket move on too; clamped, so that they never write past the last column.
        cache.positions[:rows] = torch.clamp(positions + 1, max=cache.columns - 1)
        return out.logits[:, -1, :]

    def _cache(self) -> SlotCache:
        assert self.cache is not None, "reserve() first"
        return self.cache


def _config(model: Any) -> Any:
    """The transformers config of `model`, a PreTrainedModel or a PeftModel around one."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.config


@contextlib.contextmanager
def _attention(model: Any, implementation: str) -> Iterator[None]:
    """Run `model` with another registered attention implementation (read at each forward pass)."""
    config = _config(model)
    before = config._attn_implementation
    config._attn_implementation = implementation
    try:
        yield
    finally:
        config._attn_implementation = before


def plain_layers(cache: Cache) -> bool:
    """Whether every layer of `cache` is a plain full-attention `DynamicLayer` (sliding-window and other layers
    keep their own kind of cache)."""
    return all(type(layer) is DynamicLayer for layer in cache.layers)


def unsupported_reason(model: Any) -> str | None:
    """Why `model` cannot decode from slots by its config alone (None: try it, `check_slots`)."""
    config = _config(model)
    if not plain_layers(DynamicCache(config=config)):
        return "its cache layers are not all full attention (sliding windows)"
    if getattr(config.get_text_config(decoder=True), "attn_logit_softcapping", None):
        return "it soft-caps attention logits"
    return None
