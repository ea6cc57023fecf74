"""GPU presets: the size arithmetic against published and counted sizes, what fits a T4, detection, overrides,
and how `_internal_config`, the preset and engine_options combine into vLLM's command line."""

import warnings

import pytest
import torch

import artnb as art
from artnb import models
from artnb.backends import gpu_presets
from artnb.backends.gpu_presets import (
    CARDS,
    QWEN2_5,
    GPUPreset,
    ModelShape,
    card_from_device,
    choose_preset,
    peft_needs_checkpointing,
)
from artnb.backends.model_setup import model_settings
from artnb.dev.settings import resolve_internal_config

GIB = 2**30


@pytest.mark.parametrize(
    ("size", "total", "non_embedding"),
    [("0.5B", 0.49, 0.36), ("1.5B", 1.54, 1.31), ("3B", 3.09, 2.77), ("7B", 7.61, 6.53)],
)
def test_parameter_counts_match_the_qwen_model_cards(size, total, non_embedding):
    """The model cards give billions of parameters, total and without embeddings, to two decimals."""
    shape = QWEN2_5[size]
    assert abs(shape.num_params() / 1e9 - total) < 0.01
    assert abs((shape.num_params() - shape.embedding_params()) / 1e9 - non_embedding) < 0.01


@pytest.mark.parametrize("build", ["tiny_llama", "tiny_qwen2"])
def test_parameter_count_equals_a_real_models(build):
    """The arithmetic counts what transformers builds from the same config (biases, norms, tied heads)."""
    from transformers import AutoModelForCausalLM

    path = models.tiny() if build == "tiny_llama" else models.random_model(models.TINY_QWEN2, dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(path)
    counted = sum(p.numel() for p in model.parameters())  # a tied head is one parameter
    shape = gpu_presets.model_shape(path)
    assert shape.num_params() == counted
    assert shape.weight_bytes(False) == 2 * counted
    assert shape.qkv_bias == (build == "tiny_qwen2")
    linear = sum(m.weight.numel() for n, m in model.named_modules() if n.endswith(gpu_presets.ALL_LINEAR))
    assert shape.linear_params() == linear


def test_kv_cache_and_lora_sizes_from_the_shape():
    qwen = QWEN2_5["1.5B"]
    assert (
        qwen.kv_cache_bytes_per_token() == 2 * 28 * 2 * 128 * 2
    )  # K and V, layers, KV heads, head dim, bf16
    # r x (in + out) for q, k, v, o, gate, up, down in each of 28 layers
    per_layer = 8 * ((1536 + 1536) + 2 * (1536 + 256) + (1536 + 1536) + 2 * (1536 + 8960) + (8960 + 1536))
    assert qwen.lora_params(8) == 28 * per_layer
    four, sixteen = qwen.weight_bytes(True), qwen.weight_bytes(False)
    assert four == int(0.52 * qwen.linear_params()) + 2 * (qwen.embedding_params() + qwen.other_params())
    assert (
        0.3 < four / sixteen < 0.45
    )  # the 16-bit embedding keeps a small model's 4-bit copy above a quarter


@pytest.mark.parametrize(
    ("size", "fits_16bit", "fits_4bit"),
    [("0.5B", True, True), ("1.5B", True, True), ("3B", False, True), ("7B", False, False)],
)
def test_what_fits_a_t4(size, fits_16bit, fits_4bit):
    """Two copies of the weights (vLLM's 16-bit, the trainer's) share the T4's 14.7 GiB: up to 1.5B at 16 bits,
    3B with a 4-bit trainer, and 7B not at all (vLLM's 16-bit weights alone are 14.2 GiB)."""
    t4, shape = CARDS["T4"], QWEN2_5[size]
    for four_bit, expected in ((False, fits_16bit), (True, fits_4bit)):
        preset = choose_preset(t4, shape, load_in_4bit=four_bit)
        assert preset.fits == expected, (size, four_bit, preset.note)
        smallest = gpu_presets.plan_memory(
            t4, shape, load_in_4bit=four_bit, max_seq_length=2048, micro_batch_tokens=2048
        )
        assert smallest.fits == expected
        if not expected:
            assert (
                preset.note.startswith("does not fit: serving needs")
                and "the T4 has 14.0 GiB usable" in preset.note
            )


def test_the_t4_preset_for_3b_is_4bit_fp16_eager():
    preset = choose_preset(CARDS["T4"], QWEN2_5["3B"])
    assert (preset.load_in_4bit, preset.dtype, preset.enforce_eager, preset.fits) == (
        True,
        "float16",
        True,
        True,
    )
    plan = gpu_presets.plan_memory(
        CARDS["T4"],
        QWEN2_5["3B"],
        load_in_4bit=True,
        max_seq_length=preset.max_seq_length,
        micro_batch_tokens=preset.micro_batch_tokens,
    )
    # vLLM's share is what the trainer leaves: weights, KV cache and overhead fit in it
    vllm_budget = preset.gpu_memory_utilization * plan.total
    assert plan.vllm_weights + plan.vllm_overhead + plan.kv_cache_min <= vllm_budget
    assert vllm_budget + plan.trainer_resident + gpu_presets.CONTEXT_BYTES <= plan.usable
    assert preset.vllm_args() == [
        "--gpu-memory-utilization",
        f"{preset.gpu_memory_utilization:.2f}",
        "--max-model-len",
        str(preset.max_seq_length),
        "--dtype",
        "float16",
        "--enforce-eager",
    ]


def test_big_cards_train_7b_at_16_bits_in_bf16():
    for card in ("A100-40GB", "A100-80GB", "H100-80GB"):
        preset = choose_preset(CARDS[card], QWEN2_5["7B"])
        assert (
            preset.fits
            and not preset.load_in_4bit
            and preset.dtype == "bfloat16"
            and not preset.enforce_eager
        )
        assert 0.5 <= preset.gpu_memory_utilization <= gpu_presets.MAX_UTILIZATION
    assert (
        choose_preset(CARDS["H100-80GB"], QWEN2_5["0.5B"]).gpu_memory_utilization
        == gpu_presets.MAX_UTILIZATION
    )


def test_a_longer_context_never_fits_where_a_shorter_one_does_not():
    for card in CARDS.values():
        for shape in QWEN2_5.values():
            fits = [
                gpu_presets.plan_memory(
                    card, shape, load_in_4bit=True, max_seq_length=n, micro_batch_tokens=n
                ).fits
                for n in (2048, 4096, 8192)
            ]
            assert fits == sorted(fits, reverse=True), (card.name, shape)


@pytest.mark.parametrize(
    ("name", "gib", "capability", "card"),
    [
        ("Tesla T4", 14.75, (7, 5), "T4"),
        ("NVIDIA L4", 22.5, (8, 9), "L4"),
        ("NVIDIA A100-SXM4-40GB", 39.4, (8, 0), "A100-40GB"),
        ("NVIDIA A100 80GB PCIe", 79.2, (8, 0), "A100-80GB"),
        ("NVIDIA H100 80GB HBM3", 79.2, (9, 0), "H100-80GB"),
    ],
)
def test_known_cards_are_recognised(name, gib, capability, card):
    found = card_from_device(name, int(gib * GIB), capability)
    assert found.name == card and found.memory_gib <= CARDS[card].memory_gib


def test_an_unknown_card_gets_its_own_memory_and_capabilities():
    l40s = card_from_device("NVIDIA L40S", int(44.4 * GIB), (8, 9))  # not an L4
    assert (l40s.name, l40s.memory_gib, l40s.bf16, l40s.cuda_graphs) == ("NVIDIA L40S", 44.4, True, True)
    v100 = card_from_device("Tesla V100-SXM2-16GB", int(15.8 * GIB), (7, 0))
    assert not v100.bf16 and not v100.cuda_graphs


def test_no_preset_without_cuda_and_presets_by_card_name():
    assert not torch.cuda.is_available()
    assert gpu_presets.detect_card() is None
    assert gpu_presets.preset_for(QWEN2_5["1.5B"].config()) is None
    named = gpu_presets.preset_for(QWEN2_5["1.5B"].config(), card="T4", max_seq_length=4096)
    assert named.card == "T4" and named.max_seq_length == 4096
    with pytest.raises(ValueError, match="presets exist for"):
        gpu_presets.preset_for(QWEN2_5["1.5B"].config(), card="K80")
    with pytest.raises(TypeError, match="GPUPreset has no \\['max_len'\\]"):
        named.override(max_len=1)
    with pytest.raises(ValueError, match="no 'hidden_size'"):
        ModelShape.from_config({"model_type": "gpt2", "n_embd": 768})


def test_internal_config_overrides_the_preset_on_cuda():
    config = art.dev.InternalModelConfig(
        init_args=art.dev.InitArgs(max_seq_length=4096, load_in_4bit=True, gpu_memory_utilization=0.5),
        engine_args=art.dev.EngineArgs(enforce_eager=True),
    )
    settings = resolve_internal_config(config, on_cuda=True)
    assert settings.gpu_overrides == {
        "max_seq_length": 4096,
        "load_in_4bit": True,
        "gpu_memory_utilization": 0.5,
        "enforce_eager": True,
    }
    preset = choose_preset(CARDS["L4"], QWEN2_5["1.5B"]).override(**settings.gpu_overrides)
    assert (
        preset.max_seq_length,
        preset.load_in_4bit,
        preset.gpu_memory_utilization,
        preset.enforce_eager,
    ) == (
        4096,
        True,
        0.5,
        True,
    )


async def test_vllm_gets_the_preset_then_internal_config_then_engine_options(tmp_path):
    """The last of a flag wins on vLLM's command line: `_internal_config` overrides the preset, and the backend's
    engine_options override both. Built for CUDA here (the engine is made, not started)."""
    from artnb.backends.engines.vllm.client import vllm_import_error

    if (problem := vllm_import_error()) is not None:
        pytest.skip(f"needs vLLM to build its command line: {problem}")
    from artnb.core.store import RunStore

    base = models.tiny()
    model = art.TrainableModel(name="m", project="p", base_model=base)
    settings = resolve_internal_config({"engine_args": {"gpu_memory_utilization": 0.6}}, on_cuda=True)
    settings.gpu_preset = choose_preset(CARDS["T4"], gpu_presets.model_shape(base)).override(
        **settings.gpu_overrides
    )
    backend = art.LocalBackend(path=tmp_path, engine_options={"extra_args": ["--max-model-len", "1024"]})
    engine = backend.launcher.make("vllm", base, model, RunStore(tmp_path, "p", "m"), settings)
    command = engine.command(on_cuda=True)

    def last(flag: str) -> str:
        return command[len(command) - 1 - command[::-1].index(flag) + 1]

    assert float(last("--gpu-memory-utilization")) == 0.6  # the preset's, overridden by the config
    assert last("--max-model-len") == "1024"  # engine_options win
    assert last("--dtype") == "float16" and "--enforce-eager" in command
    assert "--enable-sleep-mode" in command  # vLLM's own CUDA default: it sleeps while the trainer steps


async def test_a_preset_given_on_a_cpu_is_reported_and_unused(tmp_path):
    preset = choose_preset(CARDS["T4"], QWEN2_5["0.5B"])
    backend = art.LocalBackend(path=tmp_path, engine="hf", gpu_preset=preset)
    model = art.TrainableModel(name="m", project="p", base_model=models.tiny())
    with pytest.warns(
        UserWarning, match=r"gpu_preset=...\) has no effect here: this machine has no CUDA GPU"
    ):
        settings = model_settings(model, models.tiny(), backend.gpu_preset, on_cuda=False)
    assert settings.gpu_preset is None
    with pytest.raises(TypeError, match="gpu_preset='T4'"):
        art.LocalBackend(path=tmp_path, gpu_preset="T4")


def test_the_tutorial_settings_pick_no_preset_on_a_cpu(monkeypatch):
    monkeypatch.delenv("ARTNB_LOW_MEMORY", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        settings = art.tutorial.Settings()
    assert settings.gpu is None and settings.backend().gpu_preset == "auto"
    assert settings.train_config().micro_batch_tokens == art.TrainConfig().micro_batch_tokens
    on_gpu = art.tutorial.Settings(gpu=choose_preset(CARDS["T4"], QWEN2_5["1.5B"]))
    assert on_gpu.train_config().micro_batch_tokens == on_gpu.gpu.micro_batch_tokens
    assert isinstance(on_gpu.backend().gpu_preset, GPUPreset)


def test_peft_on_a_gpu_checkpoints_when_a_presets_micro_batch_would_not_fit():
    """PeftTrainer kept 65.9 GiB of activations for Qwen2.5-1.5B at 16384-token micro-batches on an H200."""
    shape = QWEN2_5["1.5B"]
    assert 3.5e6 < shape.activation_bytes_per_token_kept() < 4.5e6  # measured: 4.0 MB per token
    assert peft_needs_checkpointing(shape, 16384, free_bytes=75 * 2**30)
    assert not peft_needs_checkpointing(shape, 4096, free_bytes=75 * 2**30)
    assert not peft_needs_checkpointing(QWEN2_5["0.5B"], 16384, free_bytes=130 * 2**30)
