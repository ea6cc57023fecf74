"""MergedWeights on the tiny model, in process: merged equals LoRA, restore is bit-exact, odd adapters refuse."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from artnb import models
from artnb.backends.engines.merged_weights import MergedWeights, unmergeable_reason

IDS = torch.tensor([[1, 504, 3458, 314, 253, 1345, 30, 2]])


def lora_model(seed: int = 0, **config) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(models.tiny()).eval()
    config = {"r": 4, "target_modules": "all-linear", "init_lora_weights": False, **config}
    return get_peft_model(model, LoraConfig(**config)).eval()


@torch.inference_mode()
def logits(model, base: bool = False) -> torch.Tensor:
    if base:
        with model.disable_adapter():
            return model(IDS).logits
    return model(IDS).logits


def test_merged_equals_lora_and_restore_is_exact():
    model = lora_model()
    base, lora = logits(model, base=True), logits(model)
    originals = {name: p for name, p in model.named_parameters() if "lora_" not in name}
    merged = MergedWeights(model, "default")
    assert len(merged.swaps) == 2 * 7 and merged.nbytes > 0  # q k v o gate up down in both layers
    assert (lora - base).abs().max() > 1e-2, "the adapter must change the outputs, or this test shows nothing"
    for _ in range(3):
        merged.apply()
        assert all(swap.lora.merged for swap in merged.swaps), "PEFT must see the layers as merged"
        torch.testing.assert_close(logits(model), lora, atol=1e-5, rtol=0)
        merged.restore()
        assert torch.equal(logits(model, base=True), base)
        assert torch.equal(logits(model), lora)
    assert all(p is originals[n] for n, p in model.named_parameters() if "lora_" not in n)
    model.delete_adapter("default")  # PEFT refuses to delete a merged adapter: restored, it is not


def test_a_tied_weight_changes_only_where_the_adapter_applies():
    """LoRA on lm_head, whose weight is the embeddings': merged, the embeddings must stay the base's."""
    model = lora_model(target_modules=["lm_head"])
    embeddings = model.get_input_embeddings().weight
    assert model.get_output_embeddings().base_layer.weight is embeddings, "tiny model ties its embeddings"
    lora = logits(model)
    merged = MergedWeights(model, "default")
    merged.apply()
    assert model.get_input_embeddings().weight is embeddings
    torch.testing.assert_close(logits(model), lora, atol=1e-5, rtol=0)
    merged.restore()
    assert model.get_output_embeddings().base_layer.weight is embeddings


@pytest.mark.parametrize(
    "config, reason",
    [
        ({"use_dora": True}, "LoRA variant"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"target_modules": ["embed_tokens"]}, "embedding layer"),
        ({"bias": "all"}, "biases"),
    ],
)
def test_adapters_that_cannot_merge_say_why(config, reason):
    model = lora_model(**config)
    assert reason in unmergeable_reason(model, "default")
    with pytest.raises(ValueError, match=f"cannot be merged: .*{reason}.*serve it as LoRA"):
        MergedWeights(model, "default")


def test_a_plain_lora_adapter_is_mergeable():
    assert unmergeable_reason(lora_model(target_modules=["q_proj", "v_proj"]), "default") is None
