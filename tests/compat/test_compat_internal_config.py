"""ART's `_internal_config` means something here: what is honoured reaches the LoRA, the trainer and the engine,
and what has no meaning on this machine is reported once, by name.

ART's notebooks write `model._internal_config = art.dev.InternalModelConfig(init_args=art.dev.InitArgs(
max_seq_length=8192), engine_args=art.dev.EngineArgs(enforce_eager=True, gpu_memory_utilization=0.8))` for a
T4; artnb/dev/settings.py decides what each key becomes.
"""

from __future__ import annotations

import json
import warnings

import pytest

import artnb as art
from artnb import models
from artnb.core import ignored
from artnb.dev import resolve_internal_config
from artnb.local import LocalBackend


@pytest.fixture(autouse=True)
def _report_afresh(monkeypatch):
    monkeypatch.setattr(ignored, "_reported", set())


def test_honoured_keys_become_lora_trainer_and_vllm_settings():
    config = art.dev.InternalModelConfig(
        init_args=art.dev.InitArgs(max_seq_length=4096, use_gradient_checkpointing="unsloth", random_state=7),
        engine_args=art.dev.EngineArgs(enforce_eager=True, max_num_seqs=8, enable_prefix_caching=False),
        peft_args=art.dev.PeftArgs(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]),
        trainer_args=art.dev.TrainerArgs(seed=3),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing here is ignored
        settings = resolve_internal_config(config, on_cuda=False)
    assert settings.max_seq_length == 4096
    assert settings.lora == {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    assert settings.trainer == {
        "gradient_checkpointing": True,
        "seed": 3,
    }  # trainer_args come after init_args
    args = settings.vllm_args
    assert "--enforce-eager" in args and "--no-enable-prefix-caching" in args
    assert args[args.index("--max-num-seqs") + 1] == "8"
    assert args[args.index("--max-model-len") + 1] == "4096"  # the longest sequence trained is also served


def test_art_05_lora_config_names_map_to_the_same_lora():
    settings = resolve_internal_config({"lora_config": art.dev.LoRAConfig(rank=16, alpha=32)}, on_cuda=False)
    assert settings.lora == {"r": 16, "alpha": 32}


def test_gpu_and_unsloth_knobs_are_reported_once_each_by_name():
    config = art.dev.InternalModelConfig(
        init_args=art.dev.InitArgs(load_in_4bit=True, fast_inference=True),
        engine_args=art.dev.EngineArgs(gpu_memory_utilization=0.8, enforce_eager=True),
        trainer_gpu_ids=[0],
        inference_gpu_ids=[1],
    )
    with pytest.warns(UserWarning) as caught:
        settings = resolve_internal_config(config, on_cuda=False)
    messages = [str(w.message) for w in caught]
    for name in (
        "_internal_config.init_args.load_in_4bit",
        "_internal_config.init_args.fast_inference",
        "_internal_config.engine_args.gpu_memory_utilization",
        "_internal_config.trainer_gpu_ids and inference_gpu_ids",
    ):
        assert sum(name + " is accepted for ART compatibility but ignored" in m for m in messages) == 1, name
    assert settings.vllm_args == ["--enforce-eager"]  # the GPU share never reaches vLLM on a CPU
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second model with the same knobs: no second report
        resolve_internal_config(config, on_cuda=False)


def test_gpu_settings_pass_to_vllm_on_cuda():
    settings = resolve_internal_config({"engine_args": {"gpu_memory_utilization": 0.7}}, on_cuda=True)
    assert settings.vllm_args == ["--gpu-memory-utilization", "0.7"]


def test_a_config_that_is_not_a_dict_is_an_error():
    with pytest.raises(TypeError, match="InternalModelConfig"):
        resolve_internal_config(["init_args"], on_cuda=False)


async def test_a_registered_model_trains_with_its_internal_config(tmp_path):
    """LoRA rank from peft_args and max_seq_length from init_args reach the run the backend starts."""
    base = models.tiny(hidden_size=64, num_layers=2, seed=1)
    model = art.TrainableModel(name="cfg", project="p", base_model=base)
    model._internal_config = art.dev.InternalModelConfig(
        init_args=art.dev.InitArgs(max_seq_length=24),
        peft_args=art.dev.PeftArgs(r=4, lora_alpha=8),
    )
    async with LocalBackend(path=str(tmp_path), engine="hf") as backend:
        await model.register(backend)
        adapter = json.loads((model.store.checkpoint_path(0) / "adapter_config.json").read_text())
        assert (adapter["r"], adapter["lora_alpha"]) == (4, 8)
        client = model.openai_client()
        prompt = [{"role": "user", "content": "word " * 40}]  # far over 24 tokens
        groups = []
        for reward in (0.0, 1.0):
            reply = await client.chat.completions.create(
                model=model.get_inference_name(), messages=prompt, max_tokens=2
            )
            groups.append(art.Trajectory(messages_and_choices=[*prompt, reply.choices[0]], reward=reward))
        with pytest.warns(UserWarning, match="max_seq_length=24"):
            with pytest.raises(art.NothingToTrainError, match="max_seq_length"):
                await backend.train(model, [art.TrajectoryGroup(groups)], learning_rate=1e-3)
        assert await model.get_step() == 0
