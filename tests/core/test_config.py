"""TrainConfig and resolve_train_config: ART's training keywords, mapped, honoured or reported, in one place."""

import warnings

import pytest
from pydantic import ValidationError

import artnb as art
from artnb.core import ignored
from artnb.core.config import TrainConfig, resolve_train_config

# the keywords of ART's latest LocalBackend.train, with their defaults
ART_TRAIN_DEFAULTS = dict(
    learning_rate=5e-6,
    loss_fn="cispo",
    loss_fn_config=None,
    normalize_advantages=True,
    adam_params=None,
    kl_penalty_coef=0.0,
    kl_penalty_reference_step=None,
    kl_ref_adapter_path=None,
    kl_penalty_source="current_learner",
    epsilon=None,
    epsilon_high=None,
    advantage_balance=0.0,
    scale_rewards=True,
    importance_sampling_level="token",
    max_negative_advantage_importance_sampling_weight=None,
    mask_prob_ratio=False,
    kimi_k2_tau=None,
    precalculate_logprobs=False,
    allow_training_without_logprobs=False,
    plot_tensors=False,
    truncated_importance_sampling=None,
    scale_learning_rate_by_reward_std_dev=False,
    logprob_calculation_chunk_size=1024,
    packed_sequence_length=None,
    megatron_topology=None,
    num_trajectories_learning_rate_multiplier_power=0.0,
    save_checkpoint=True,
    optimizer_save_interval=5,
    final_training_step=None,
    grad_accumulation_sequences=None,
    verbose=False,
)

# every key of ART's dev.TrainConfig TypedDict across versions, with a value that asks for something
DEV_CONFIG_KEYS = {
    "advantage_balance": 0.5,
    "allow_training_without_logprobs": True,
    "epsilon": 0.1,
    "epsilon_high": 0.3,
    "importance_sampling_level": "sequence",
    "kimi_k2_tau": 0.1,
    "kl_penalty_coef": 0.02,
    "kl_penalty_reference_step": 3,
    "kl_penalty_source": "sample",
    "kl_penalty_step_lag": 2,
    "kl_ref_adapter_path": "/tmp/ref",
    "logprob_calculation_chunk_size": 8,
    "mask_prob_ratio": True,
    "max_negative_advantage_importance_sampling_weight": 3.0,
    "megatron_topology": {"tp": 2},
    "moe_routing_replay_bundle": object(),
    "moe_routing_replay_path": "/tmp/routes",
    "moe_routing_replay_strict": False,
    "normalize_by_length": True,
    "num_trajectories_learning_rate_multiplier_power": 0.5,
    "packed_sequence_length": 4096,
    "plot_tensors": True,
    "ppo": True,
    "precalculate_logprobs": True,
    "scale_learning_rate_by_reward_std_dev": True,
    "scale_rewards": False,
    "truncated_importance_sampling": 2.0,
    "tinker_loss_fn": "ppo",
    "tinker_loss_fn_config": {"clip_low_threshold": 0.0},
}


@pytest.fixture(autouse=True)
def fresh_reports(monkeypatch):
    """Each test sees every ignored keyword for the first time in the process."""
    monkeypatch.setattr(ignored, "_reported", set())


def test_art_train_config_constructs_with_beta():
    config = art.TrainConfig(learning_rate=1e-5, beta=0.04)
    assert config.kl_penalty_coef == 0.04
    assert config.model_dump(exclude_unset=True) == {"learning_rate": 1e-5, "kl_penalty_coef": 0.04}
    with pytest.raises(ValidationError, match="not both"):
        TrainConfig(beta=0.1, kl_penalty_coef=0.1)


def test_train_config_stays_strict():
    with pytest.raises(ValidationError, match="learning_rte"):
        TrainConfig(learning_rte=1e-3)
    with pytest.raises(ValidationError, match="plot_tensors"):
        TrainConfig(plot_tensors=True)  # ART knobs are keywords to train(), not TrainConfig fields
    with pytest.raises(ValidationError):
        TrainConfig(advantage_balance=1.5)
    with pytest.raises(ValidationError):
        TrainConfig(importance_sampling_level="group")


def test_keywords_override_the_configs_set_fields():
    config = TrainConfig(learning_rate=1e-3, loss_fn="ppo")
    resolved = resolve_train_config(config, {"learning_rate": 1e-4, "epsilon": 0.1})
    assert (resolved.learning_rate, resolved.loss_fn, resolved.epsilon) == (1e-4, "ppo", 0.1)
    assert resolve_train_config(None, {}) == TrainConfig()


def test_unknown_keywords_raise_and_list_the_valid_ones():
    with pytest.raises(TypeError, match=r"unknown training option\(s\) \['learning_rte'\].*learning_rate"):
        resolve_train_config(None, {"learning_rte": 1e-3})
    with pytest.raises(TypeError, match=r"unknown _config key\(s\) \['ppo_clip'\].*normalize_advantages"):
        resolve_train_config(None, {}, {"ppo_clip": 0.2})


def test_art_defaults_are_accepted_silently_and_change_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_train_config(None, ART_TRAIN_DEFAULTS) == TrainConfig()
        assert resolve_train_config(None, {}, ART_TRAIN_DEFAULTS) == TrainConfig()


def test_art_names_are_mapped():
    assert resolve_train_config(None, {"beta": 0.1}).kl_penalty_coef == 0.1
    assert resolve_train_config(None, {"normalize_advantages": False}).scale_rewards is False
    assert (
        resolve_train_config(TrainConfig(scale_rewards=False), {"normalize_advantages": True}).scale_rewards
        is False
    )
    assert resolve_train_config(None, {}, {"ppo": True}).loss_fn == "ppo"
    assert resolve_train_config(TrainConfig(loss_fn="ppo"), {}, {"ppo": False}).loss_fn == "cispo"
    with pytest.raises(ValueError, match="beta=0.1 means kl_penalty_coef=0.1"):
        resolve_train_config(None, {"beta": 0.1, "kl_penalty_coef": 0.2})
    with pytest.raises(ValueError, match="normalize_advantages=False means scale_rewards=False"):
        resolve_train_config(None, {"normalize_advantages": False, "scale_rewards": True})


def test_dev_config_sits_between_the_config_and_the_keywords():
    config = TrainConfig(learning_rate=1e-3, epsilon=0.3, epsilon_high=0.3)
    resolved = resolve_train_config(config, {"epsilon": 0.1}, {"epsilon": 0.2, "epsilon_high": 0.25})
    assert (resolved.learning_rate, resolved.epsilon, resolved.epsilon_high) == (1e-3, 0.1, 0.25)
    assert resolve_train_config(None, {"loss_fn": "cispo"}, {"ppo": True}).loss_fn == "cispo"


def test_honoured_keywords_reach_the_config():
    honoured = dict(
        importance_sampling_level="sequence",
        logprob_calculation_chunk_size=64,
        precalculate_logprobs=True,
        verbose=True,
        max_negative_advantage_importance_sampling_weight=2.0,
        mask_prob_ratio=True,
        kimi_k2_tau=0.1,
        advantage_balance=-0.5,
        num_trajectories_learning_rate_multiplier_power=0.5,
        truncated_importance_sampling=2.0,
        allow_training_without_logprobs=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolved = resolve_train_config(None, honoured)
    assert resolved.model_dump(include=set(honoured)) == honoured


def test_ignored_knobs_are_reported_once_per_name_with_the_reason():
    with pytest.warns(UserWarning) as caught:
        resolve_train_config(None, {"packed_sequence_length": 4096, "save_checkpoint": False})
    messages = sorted(str(w.message) for w in caught)
    assert len(messages) == 2
    assert "train(packed_sequence_length=...)" in messages[0] and "not packed" in messages[0]
    assert "train(save_checkpoint=...)" in messages[1] and "delete_checkpoints" in messages[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same names again, even from _config: no second report
        resolve_train_config(None, {"packed_sequence_length": 2048}, {"save_checkpoint": False})


def test_every_dev_train_config_key_is_accepted():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resolved = resolve_train_config(None, {}, DEV_CONFIG_KEYS)
    assert resolved.loss_fn == "ppo" and resolved.importance_sampling_level == "sequence"
    assert resolved.scale_rewards is False and resolved.kl_penalty_coef == 0.02
    reported = {str(w.message).split("(")[1].split("=")[0] for w in caught}
    assert reported == {
        "kl_penalty_reference_step",
        "kl_penalty_source",
        "kl_penalty_step_lag",
        "kl_ref_adapter_path",
        "megatron_topology",
        "moe_routing_replay_bundle",
        "moe_routing_replay_path",
        "moe_routing_replay_strict",
        "normalize_by_length",
        "packed_sequence_length",
        "plot_tensors",
        "scale_learning_rate_by_reward_std_dev",
        "tinker_loss_fn",
        "tinker_loss_fn_config",
    }


def test_loss_fn_config_and_adam_params_must_be_none():
    assert resolve_train_config(None, {"loss_fn_config": None, "adam_params": None}) == TrainConfig()
    with pytest.raises(ValueError, match="loss_fn_config must be None"):
        resolve_train_config(None, {"loss_fn_config": {"clip": 0.2}})
    with pytest.raises(ValueError, match="adam_params must be None.*learning_rate"):
        resolve_train_config(None, {}, {"adam_params": {"beta1": 0.9}})


def test_bad_values_still_fail_validation():
    with pytest.raises(ValidationError, match="logprob_calculation_chunk_size"):
        resolve_train_config(None, {"logprob_calculation_chunk_size": 0})
    with pytest.raises(ValidationError, match="kl_penalty_coef"):
        resolve_train_config(None, {"beta": -1.0})


def test_art_lora_config_refuses_a_misspelled_key_with_the_nearest_names(monkeypatch):
    """`lora_config={"rnak": 16}` used to be reported as an ignored ART option, leaving the default rank."""
    monkeypatch.setattr(ignored, "_reported", set())
    with pytest.raises(
        ValueError,
        match=r"unknown key in lora_config, one neither artnb nor ART has \(got 'rnak'\); did you mean 'rank'",
    ):
        art.TrainableModel(name="a", project="p", base_model="x", lora_config={"rnak": 16})
    with pytest.raises(
        ValueError, match=r'lora_config\["rank"\]: Input should be a valid integer.*\(got \'eight\'\)'
    ):
        art.TrainableModel(name="a", project="p", base_model="x", lora_config={"rank": "eight"})
    with pytest.raises(TypeError, match=r"lora_config must be a dict \(got list"):
        art.TrainableModel(name="a", project="p", base_model="x", lora_config=[("rank", 16)])  # type: ignore[arg-type]
    with pytest.warns(
        UserWarning, match="lora_config.use_rslora is accepted for ART compatibility but ignored"
    ):
        model = art.TrainableModel(
            name="a", project="p", base_model="x", lora_config={"rank": 16, "alpha": 32, "use_rslora": False}
        )
    assert (model.lora.r, model.lora.alpha) == (16, 32)


def test_art_0_5_23_train_config_fields_construct_and_say_what_they_change():
    """ART 0.5.23's TrainConfig fields construct; those that change nothing here are reported once each when
    set, however they reach the step (the config, `_config` or a keyword to backend.train)."""
    config = art.TrainConfig(
        learning_rate=1e-5,
        kl_penalty_coef=0.1,
        kl_penalty_source="sample",
        grad_accumulation_sequences=4,
        optimizer_save_interval=2,
        final_training_step=10,
    )
    assert (config.grad_accumulation_sequences, config.final_training_step) == (4, 10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resolved = resolve_train_config(config, {})
    assert resolved == config
    reported = {str(w.message).split("(")[1].split("=")[0]: str(w.message) for w in caught}
    assert sorted(reported) == ["grad_accumulation_sequences", "kl_penalty_source", "optimizer_save_interval"]
    assert "one optimizer step over the whole batch" in reported["grad_accumulation_sequences"]
    assert "saved with every checkpoint" in reported["optimizer_save_interval"]


def test_final_training_step_is_accepted_silently_as_a_keyword():
    """Every step saves its optimizer state and is served on return, so ART's last-step flag has nothing to do."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolved = resolve_train_config(None, {"final_training_step": 3, "kl_penalty_source": "sample"})
    assert resolved.final_training_step == 3  # 'sample' without a KL coefficient asks for nothing either
    with pytest.raises(ValidationError, match="final_training_step"):
        resolve_train_config(None, {"final_training_step": 0})
    with pytest.raises(ValidationError, match="grad_accumulation_sequences"):
        art.TrainConfig(grad_accumulation_sequences=0)
    with pytest.raises(ValidationError, match="kl_penalty_source"):
        art.TrainConfig(kl_penalty_source="reference")  # type: ignore[arg-type]
