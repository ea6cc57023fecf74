"""GPU presets: what one card holds when vLLM and the trainer share it, and the arithmetic that says so.

On one GPU artnb runs two processes: vLLM serving the base model (16-bit) with the newest adapter, and the trainer
holding its own copy of the base model (16-bit, or 4-bit with Unsloth) plus the LoRA weights and their AdamW state.
vLLM sleeps (level 1: weights to CPU, KV cache freed) while the trainer steps, and the trainer empties its cache
before vLLM wakes. So a card must hold, in bytes:

    serving:  2 contexts + trainer weights + LoRA state + vLLM weights + vLLM overhead + KV cache for 8 sequences
    training: 2 contexts + vLLM asleep + trainer weights + LoRA state and gradients + activations + a logits chunk

with every size written out below from the model's config (`ModelShape`): 2 bytes a parameter at 16 bits, 0.52 at
4 bits (NF4 with double quantisation; embeddings stay 16-bit), LoRA parameters in fp32 with AdamW's two moments
(12 bytes) and an fp32 gradient while training, KV cache 2 x layers x kv_heads x head_dim x 2 bytes a token,
activations per token with gradient checkpointing (each layer's input kept, one layer recomputed at a time), and
`logprob_calculation_chunk_size` positions of logits at once. The allowances that are not arithmetic (CUDA
contexts, vLLM's activation peak and CUDA graphs) are named constants; `benchmarks/gpu_check.py` measures the
real peak on a card.

A preset is the largest context (2048 to 8192 tokens) and micro-batch that fit, 16-bit trainer weights where they
fit and 4-bit otherwise, vLLM's `gpu_memory_utilization` set to what the trainer leaves, fp16 where the card has no
bf16 (T4) and `enforce_eager` where CUDA graphs cost memory the card lacks (T4). `preset_for` detects the card from
torch (name and total memory) and returns None without CUDA, so nothing changes on a CPU. Every field can be
overridden (`preset.override(max_seq_length=4096)`), and ART's `_internal_config` settings do so in LocalBackend.

    python -c "from artnb.backends.gpu_presets import presets_table; print(presets_table())"   # the README's table
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

GIB = 2**30

CONTEXT_BYTES = GIB // 2  # one process's CUDA context and library workspaces (0.3-0.6 GiB on recent drivers)
VLLM_OVERHEAD_BYTES = GIB  # vLLM's activation peak while profiling, sampler and LoRA buffers, eager mode
VLLM_GRAPH_BYTES = GIB // 2  # CUDA graphs on top of that, when not `enforce_eager`
VLLM_ASLEEP_BYTES = GIB // 4  # what a sleeping vLLM still holds besides its context
USABLE_SHARE = 0.95  # of total memory: allocator rounding and fragmentation take the rest
MIN_KV_SEQUENCES = 8  # one GRPO group of 8 rollouts at full length runs at once
MAX_UTILIZATION = 0.90  # vLLM's share is never set above this
BYTES_4BIT = 0.52  # NF4 weights with double-quantised block scales, per parameter of a quantised linear layer
SEQ_LENGTHS = (8192, 4096, 2048)  # contexts tried, longest first; longer ones fit big cards: override
MICRO_BATCH_TOKENS = (16384, 8192, 4096, 2048)  # padded tokens per forward/backward, largest first
LOGITS_BYTES_PER_VALUE = 14  # 16-bit logits, their fp32 copy, log_softmax and its gradient
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Card:
    """A GPU model as the presets see it."""

    name: str
    memory_gib: float  # total memory as torch reports it, a little under the label (the driver keeps some)
    bf16: bool  # bf16 tensor cores (Ampere and newer); without them training runs in fp16 with loss scaling
    cuda_graphs: (
        bool  # vLLM captures CUDA graphs; False means `enforce_eager` (T4: their memory is missed most)
    )


CARDS: dict[str, Card] = {
    "T4": Card("T4", 14.7, bf16=False, cuda_graphs=False),  # Colab's free GPU, 16 GB label
    "L4": Card("L4", 22.0, bf16=True, cuda_graphs=True),  # 24 GB label
    "A100-40GB": Card("A100-40GB", 39.3, bf16=True, cuda_graphs=True),
    "A100-80GB": Card("A100-80GB", 79.1, bf16=True, cuda_graphs=True),
    "H100-80GB": Card("H100-80GB", 79.1, bf16=True, cuda_graphs=True),
}


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that memory depends on, as its config.json states them."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool = False  # Qwen2 has biases on q, k and v
    max_position_embeddings: int = 32768

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | Any) -> ModelShape:
        """From a config.json dict or a transformers config (multimodal ones: their `text_config`)."""
        cfg = dict(config) if isinstance(config, Mapping) else config.to_dict()
        cfg = cfg.get("text_config") or cfg
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            return cls(
                hidden_size=hidden,
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate_size=int(cfg["intermediate_size"]),
                vocab_size=int(cfg["vocab_size"]),
                tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
                max_position_embeddings=int(cfg.get("max_position_embeddings") or 32768),
            )
        except KeyError as missing:
            raise ValueError(
                f"the model config has no {missing}: GPU presets need a decoder-only transformer config with "
                "hidden_size, num_hidden_layers, num_attention_heads, intermediate_size and vocab_size"
            ) from None

    def config(self, model_type: str = "qwen2") -> dict[str, Any]:
        """A config.json dict of this shape, e.g. for `artnb.models.random_model` (weights without a download)."""
        return {
            "model_type": model_type,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tied_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
        }

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer in one decoder layer."""
        h, q, kv, i = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def linear_params(self) -> int:
        """Weights of the decoder's linear layers (what 4-bit quantises)."""
        return self.num_layers * sum(a * b for a, b in self.linear_shapes().values())

    def embedding_params(self) -> int:
        """Input embedding plus the LM head when it is not tied to it (kept 16-bit at 4 bits too)."""
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)

    def other_params(self) -> int:
        """Norms and biases."""
        bias = self.q_dim + 2 * self.kv_dim if self.qkv_bias else 0
        return self.num_layers * (2 * self.hidden_size + bias) + self.hidden_size

    def num_params(self) -> int:
        return self.linear_params() + self.embedding_params() + self.other_params()

    def weight_bytes(self, load_in_4bit: bool) -> int:
        if not load_in_4bit:
            return 2 * self.num_params()
        return int(BYTES_4BIT * self.linear_params()) + 2 * (self.embedding_params() + self.other_params())

    def kv_cache_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """vLLM's KV cache for one token: keys and values of every layer."""
        return 2 * self.num_layers * self.kv_dim * dtype_bytes

    def lora_params(self, rank: int, targets: tuple[str, ...] = ALL_LINEAR) -> int:
        shapes = self.linear_shapes()
        return self.num_layers * sum(rank * sum(shapes[t]) for t in targets if t in shapes)

    def activation_bytes_per_token(self) -> int:
        """Training activations per token with gradient checkpointing: each layer's 16-bit input kept, plus one
        layer's tensors recomputed in backward (norm outputs, q/k/v, attention output, the MLP's three
        intermediate-size tensors) and their gradients."""
        h, i = self.hidden_size, self.intermediate_size
        kept = self.num_layers * h * 2
        one_layer = 2 * 2 * (4 * h + self.q_dim + 2 * self.kv_dim + 3 * i)
        return kept + one_layer

    def activation_bytes_per_token_kept(self) -> int:
        """Training activations per token without gradient checkpointing (PEFT's default): every layer keeps its
        16-bit tensors for backward, about twice the layer's visible outputs once autograd's saved inputs
        (norms, activation function, attention) count. Measured on an H200: 4.0 MB per token for Qwen2.5-1.5B
        (PeftTrainer, 16384-token micro-batches, 65.9 GiB); this gives 3.9 MB."""
        h, i = self.hidden_size, self.intermediate_size
        return self.num_layers * 2 * 2 * (4 * h + self.q_dim + 2 * self.kv_dim + 3 * i)

    def training_flops_per_token(self, context: float) -> float:
        """Model FLOPs of one trained token with LoRA: forward plus the backward to the activations (the frozen
        weights get no gradient), i.e. 2 x the forward: 2 x params of the linear layers plus attention scores
        and values over `context` earlier tokens (the mean causal context of the sequence). The LM head is
        counted by the caller for the positions whose logits are computed."""
        forward = 2 * self.linear_params() + 4 * self.num_layers * self.q_dim * context
        return 2 * forward

    def head_flops_per_position(self) -> float:
        """Forward + backward FLOPs of the LM head for one position whose logits are computed."""
        return 2 * 2 * self.hidden_size * self.vocab_size


# Qwen2.5 as its published config.json files give it; model cards: 0.49B, 1.54B, 3.09B, 7.61B parameters.
QWEN2_5: dict[str, ModelShape] = {
    "0.5B": ModelShape(896, 24, 14, 2, 64, 4864, 151936, tied_embeddings=True, qkv_bias=True),
    "1.5B": ModelShape(1536, 28, 12, 2, 128, 8960, 151936, tied_embeddings=True, qkv_bias=True),
    "3B": ModelShape(2048, 36, 16, 2, 128, 11008, 151936, tied_embeddings=True, qkv_bias=True),
    "7B": ModelShape(3584, 28, 28, 4, 128, 18944, 152064, tied_embeddings=False, qkv_bias=True),
}


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes on one card while serving and while training, part by part (see the module docstring)."""

    card: Card
    load_in_4bit: bool
    max_seq_length: int
    micro_batch_tokens: int
    trainer_weights: int
    lora_state: int  # fp32 LoRA weights + AdamW moments, resident all the time
    lora_grads: int
    vllm_weights: int
    vllm_overhead: int
    kv_cache_min: int  # MIN_KV_SEQUENCES sequences of max_seq_length
    activations: int
    logits_chunk: int
    dequantized_weight: int  # 4-bit: one linear layer dequantised to 16 bits at a time

    @property
    def total(self) -> int:
        return int(self.card.memory_gib * GIB)

    @property
    def usable(self) -> int:
        return int(self.total * USABLE_SHARE)

    @property
    def trainer_resident(self) -> int:
        """The trainer process while vLLM serves: context, weights, LoRA state (gradients are freed)."""
        return CONTEXT_BYTES + self.trainer_weights + self.lora_state

    @property
    def serving(self) -> int:
        return (
            self.trainer_resident + CONTEXT_BYTES + self.vllm_weights + self.vllm_overhead + self.kv_cache_min
        )

    @property
    def training(self) -> int:
        return (
            self.trainer_resident
            + CONTEXT_BYTES
            + VLLM_ASLEEP_BYTES
            + self.lora_grads
            + self.activations
            + self.logits_chunk
            + self.dequantized_weight
        )

    @property
    def fits(self) -> bool:
        return self.serving <= self.usable and self.training <= self.usable

    @property
    def gpu_memory_utilization(self) -> float:
        """vLLM's share of the card: all the trainer and vLLM's own context leave of the usable memory."""
        share = (self.usable - self.trainer_resident - CONTEXT_BYTES) / self.total
        return max(0.05, min(MAX_UTILIZATION, math.floor(share * 100) / 100))

    def summary(self) -> str:
        gib = lambda n: f"{n / GIB:.1f} GiB"  # noqa: E731
        return (
            f"serving needs {gib(self.serving)} (trainer {gib(self.trainer_resident)}, vLLM weights "
            f"{gib(self.vllm_weights)}, KV cache for {MIN_KV_SEQUENCES} x {self.max_seq_length} tokens "
            f"{gib(self.kv_cache_min)}), training needs {gib(self.training)}; the {self.card.name} has "
            f"{gib(self.usable)} usable"
        )


def plan_memory(
    card: Card,
    shape: ModelShape,
    *,
    load_in_4bit: bool,
    max_seq_length: int,
    micro_batch_tokens: int,
    lora_rank: int = 8,
    logprob_chunk: int = 1024,
) -> MemoryPlan:
    """What `shape` needs on `card` with these settings; `.fits` says whether both phases fit."""
    lora = shape.lora_params(lora_rank)
    tokens = max(micro_batch_tokens, max_seq_length)  # a longer sequence goes alone into its micro-batch
    largest_linear = max(a * b for a, b in shape.linear_shapes().values())
    return MemoryPlan(
        card=card,
        load_in_4bit=load_in_4bit,
        max_seq_length=max_seq_length,
        micro_batch_tokens=micro_batch_tokens,
        trainer_weights=shape.weight_bytes(load_in_4bit),
        lora_state=12 * lora,
        lora_grads=4 * lora,
        vllm_weights=shape.weight_bytes(False),
        vllm_overhead=VLLM_OVERHEAD_BYTES + (VLLM_GRAPH_BYTES if card.cuda_graphs else 0),
        kv_cache_min=MIN_KV_SEQUENCES * max_seq_length * shape.kv_cache_bytes_per_token(),
        activations=tokens * shape.activation_bytes_per_token(),
        logits_chunk=min(logprob_chunk, tokens) * shape.vocab_size * LOGITS_BYTES_PER_VALUE,
        dequantized_weight=2 * largest_linear if load_in_4bit else 0,
    )


@dataclass(frozen=True)
class GPUPreset:
    """How to run one model on one card: vLLM's settings and the trainer's. `fits=False` means even the smallest
    settings were over the card (`note` says by how much); LocalBackend warns and uses them anyway."""

    card: str
    model: str  # e.g. "1.54B parameters"
    load_in_4bit: bool  # the trainer's copy of the base model (Unsloth); vLLM always serves 16-bit weights
    dtype: Literal["bfloat16", "float16"]  # no bf16 on a T4: fp16, with loss scaling in the trainer
    gpu_memory_utilization: float  # vLLM's share of the card's memory
    max_seq_length: int  # vLLM's --max-model-len and the longest sequence trained
    micro_batch_tokens: int  # TrainConfig.micro_batch_tokens
    enforce_eager: bool  # vLLM without CUDA graphs
    fits: bool = True
    note: str = ""

    def vllm_args(self) -> list[str]:
        """vLLM command-line flags; later flags (the model's `_internal_config`, engine_options) override them."""
        args = ["--gpu-memory-utilization", f"{self.gpu_memory_utilization:.2f}"]
        args += ["--max-model-len", str(self.max_seq_length), "--dtype", self.dtype]
        return args + (["--enforce-eager"] if self.enforce_eager else [])

    def override(self, **changes: Any) -> GPUPreset:
        """A copy with some fields changed, e.g. `preset.override(max_seq_length=4096, load_in_4bit=True)`."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(
                f"GPUPreset has no {unknown}; its fields: {[f.name for f in dataclasses.fields(self)]}"
            )
        return dataclasses.replace(self, **changes)


def choose_preset(
    card: Card,
    shape: ModelShape,
    *,
    lora_rank: int = 8,
    load_in_4bit: bool | None = None,
) -> GPUPreset:
    """The preset for `shape` on `card`: 16-bit trainer weights before 4-bit (unless `load_in_4bit` says), the
    longest context of SEQ_LENGTHS, then the largest micro-batch of MICRO_BATCH_TOKENS, that fit."""
    precisions = (False, True) if load_in_4bit is None else (load_in_4bit,)
    lengths = [n for n in SEQ_LENGTHS if n <= shape.max_position_embeddings] or [
        shape.max_position_embeddings
    ]
    smallest = None
    for four_bit in precisions:
        for length in lengths:
            for micro in [m for m in MICRO_BATCH_TOKENS if m >= length] or [length]:
                plan = plan_memory(
                    card,
                    shape,
                    load_in_4bit=four_bit,
                    max_seq_length=length,
                    micro_batch_tokens=micro,
                    lora_rank=lora_rank,
                )
                if plan.fits:
                    return _preset(card, shape, plan)
                smallest = plan
    assert smallest is not None
    return dataclasses.replace(
        _preset(card, shape, smallest), fits=False, note=f"does not fit: {smallest.summary()}"
    )


def _preset(card: Card, shape: ModelShape, plan: MemoryPlan) -> GPUPreset:
    return GPUPreset(
        card=card.name,
        model=f"{shape.num_params() / 1e9:.2f}B parameters",
        load_in_4bit=plan.load_in_4bit,
        dtype="bfloat16" if card.bf16 else "float16",
        gpu_memory_utilization=plan.gpu_memory_utilization,
        max_seq_length=plan.max_seq_length,
        micro_batch_tokens=plan.micro_batch_tokens,
        enforce_eager=not card.cuda_graphs,
    )


def peft_needs_checkpointing(shape: ModelShape, micro_batch_tokens: int, free_bytes: int) -> bool:
    """Whether the PEFT trainer must recompute activations: a micro-batch's kept activations would take more
    than half of the GPU memory free when the trainer is built (the rest: weights, LoRA state, logits)."""
    return micro_batch_tokens * shape.activation_bytes_per_token_kept() > free_bytes // 2


def card_from_device(name: str, total_bytes: int, capability: tuple[int, int]) -> Card:
    """The preset card for a CUDA device's name, total memory and compute capability; an unknown one gets its
    own measured memory, bf16 and CUDA graphs from Ampere (8.0) on."""
    memory = total_bytes / GIB
    key = None
    if "T4" in name:
        key = "T4"
    elif re.search(r"\bL4\b", name):  # not the L40 / L40S
        key = "L4"
    elif "A100" in name:
        key = "A100-80GB" if memory > 60 else "A100-40GB"
    elif "H100" in name and memory < 90:
        key = "H100-80GB"
    if key is not None:
        known = CARDS[key]
        return dataclasses.replace(known, memory_gib=min(known.memory_gib, memory))
    modern = capability >= (8, 0)
    return Card(name, round(memory, 1), bf16=modern, cuda_graphs=modern)


def detect_card() -> Card | None:
    """This machine's first CUDA GPU as a preset card; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return card_from_device(props.name, props.total_memory, (props.major, props.minor))


def model_shape(model: str | Mapping[str, Any]) -> ModelShape:
    """The shape of a model directory, hub id (reads its config) or config dict."""
    if isinstance(model, Mapping):
        return ModelShape.from_config(model)
    from transformers import AutoConfig

    return ModelShape.from_config(AutoConfig.from_pretrained(model))


def preset_for(
    model: str | Mapping[str, Any],
    *,
    card: Card | str | None = None,
    lora_rank: int = 8,
    **overrides: Any,
) -> GPUPreset | None:
    """The preset for `model` (a directory, hub id or config dict) on `card` (default: this machine's GPU; None
    without CUDA), with `overrides` applied, e.g. `preset_for("Qwen/Qwen2.5-3B-Instruct", max_seq_length=4096)`."""
    if isinstance(card, str):
        if card not in CARDS:
            raise ValueError(f"card={card!r}: presets exist for {sorted(CARDS)}")
        card = CARDS[card]
    card = card or detect_card()
    if card is None:
        return None
    preset = choose_preset(card, model_shape(model), lora_rank=lora_rank)
    return preset.override(**overrides) if overrides else preset


def presets_table(sizes: Mapping[str, ModelShape] = QWEN2_5) -> str:
    """A Markdown table of the presets for `sizes` on every card (the README's)."""
    lines = [
        "| card | model | trainer weights | vLLM share | context | micro-batch tokens | dtype | eager |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for card in CARDS.values():
        for label, shape in sizes.items():
            p = choose_preset(card, shape)
            if not p.fits:
                lines.append(f"| {card.name} | Qwen2.5-{label} | does not fit | | | | | |")
                continue
            lines.append(
                f"| {card.name} | Qwen2.5-{label} | {'4-bit' if p.load_in_4bit else '16-bit'} | "
                f"{p.gpu_memory_utilization:.2f} | {p.max_seq_length} | {p.micro_batch_tokens} | {p.dtype} | "
                f"{'yes' if p.enforce_eager else 'no'} |"
            )
    return "\n".join(lines)
