"""One LoRA adapter merged into the base model's linear weights, swapped in and out without arithmetic.

Why: RL samples from the newest adapter, and unmerged LoRA adds two small matmuls (and their thread
wake-ups) to every adapted linear layer at every decoding step, which on a CPU made the HF engine with an
adapter ~30% slower than with the base model. Merged, the adapter costs exactly what the base model costs.

How: for the merge target, each adapted layer gets a second weight tensor, W + scale * B @ A (PEFT's own
`get_delta_weight`, and B's bias if the adapter trains one), built once. Merging and unmerging then only
swap which `nn.Parameter` the layer points at, and mark the layer merged the way PEFT's own merge does
(`merged_adapters`), so PEFT runs only the base layer there:
- the original parameters are never written, so the base model (and every other adapter, served as LoRA on
  top of it) is bit-exact however often the engine switches. PEFT's in-place merge then unmerge,
  W + d - d, is not exact in floating point: on SmolLM2-135M with an all-linear r=8 adapter, one round
  trip left 5% of the adapted weights an ulp off and moved the base model's logprobs by up to 5e-5;
- a switch costs no arithmetic, so alternating base and adapter requests costs nothing extra;
- swapping the parameter (not its `.data`) leaves a weight tied to another module (an adapted `lm_head`
  tied to the embeddings) untouched elsewhere, as unmerged LoRA would.
The price is memory: one extra copy of the adapted layers' weights while a target is merged (all linear
layers of SmolLM2-135M: ~425 MB in fp32), and one merge pass (a B @ A per layer) per new target.

Only plain LoRA on float `nn.Linear` layers merges; `unmergeable_reason` says why another adapter cannot
(DoRA and the other variants, embedding LoRA, modules_to_save, trainable tokens, trained base biases), and
the engine serves those unmerged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


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
