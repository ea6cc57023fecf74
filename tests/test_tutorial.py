"""Tutorial settings: quick mode on a CPU, a real model on a GPU, low memory on Binder, from one cell."""

import pytest

import artnb as art


def test_quick_defaults_on_the_embedded_model(monkeypatch):
    monkeypatch.delenv("ARTNB_LOW_MEMORY", raising=False)
    s = art.tutorial.Settings()
    assert (s.steps, s.groups_per_step, s.group_size, s.eval_scenarios) == (1, 2, 4, 4)
    assert s.learning_rate == 1e-3 and not s.low_memory
    assert s.scenarios(0) == [0, 1] and s.scenarios(3) == [6, 7]
    assert not set(s.evaluation_scenarios()) & {x for step in range(100) for x in s.scenarios(step)}
    backend = s.backend()
    assert backend.engine == "auto" and not backend.trainer_config.gradient_checkpointing
    assert s.train_config().learning_rate == 1e-3 and s.train_config(learning_rate=3e-3).learning_rate == 3e-3


def test_a_real_model_on_a_gpu_gets_a_real_run():
    s = art.tutorial.Settings(base_model="Qwen/Qwen2.5-3B-Instruct", quick=False, low_memory=False)
    assert (s.steps, s.groups_per_step, s.group_size, s.eval_scenarios) == (30, 4, 8, 32)
    assert s.learning_rate == 1e-5


def test_binder_low_memory_from_the_environment(monkeypatch):
    monkeypatch.setenv("ARTNB_LOW_MEMORY", "1")
    s = art.tutorial.Settings()
    backend = s.backend()
    assert s.low_memory and backend.engine == "hf" and backend.trainer_config.gradient_checkpointing
    assert s.train_config().micro_batch_tokens == 512


def test_a_plain_local_backend_takes_low_memory_settings_from_binders_environment(monkeypatch):
    monkeypatch.setenv("ARTNB_LOW_MEMORY", "1")
    backend = art.LocalBackend(path=None)
    assert backend.engine == "hf" and backend.trainer_config.gradient_checkpointing
    assert backend.engine_options == {"max_batch_size": 8}
    chosen = art.LocalBackend(path=None, engine="vllm", trainer_config=art.TrainerConfig(), low_memory=None)
    assert (
        chosen.engine == "vllm"
        and not chosen.trainer_config.gradient_checkpointing
        and not chosen.engine_options
    )
    monkeypatch.delenv("ARTNB_LOW_MEMORY")
    assert art.LocalBackend(path=None).engine == "auto"
    assert art.LocalBackend(path=None, low_memory=True).engine == "hf"


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="group_size=1: GRPO compares rollouts"):
        art.tutorial.Settings(group_size=1)
    with pytest.raises(Exception, match="unknown_option|extra"):
        art.tutorial.Settings().train_config(unknown_option=1)
