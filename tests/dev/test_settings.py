"""`_internal_config` refuses bad input at register, before anything loads: a key neither artnb nor ART has gets
the nearest names, a value of the wrong type or range is named as it was written, and a section that is not a
dict says so. Keys ART has that artnb does not use keep their "accepted ... but ignored" report."""

from __future__ import annotations

import warnings

import pytest

import artnb as art
from artnb.core import ignored
from artnb.dev import resolve_internal_config
from artnb.dev.settings import check_internal_config

INIT_MSL = r'_internal_config\["init_args"\]\["max_seq_length"\]'


@pytest.fixture(autouse=True)
def _report_afresh(monkeypatch):
    monkeypatch.setattr(ignored, "_reported", set())


def resolve(config, on_cuda: bool = False):
    return resolve_internal_config(config, on_cuda=on_cuda)


@pytest.mark.parametrize(
    ("config", "where", "suggested"),
    [
        ({"init_arg": {"max_seq_length": 4096}}, "_internal_config", "'init_args'"),
        ({"init_args": {"max_seq_len": 4096}}, r'_internal_config\["init_args"\]', "'max_seq_length'"),
        ({"peft_args": {"lora_alpa": 32}}, r'_internal_config\["peft_args"\]', "'lora_alpha'"),
        ({"lora_config": {"rnak": 16}}, r'_internal_config\["lora_config"\]', "'rank'"),
    ],
)
def test_a_misspelled_key_is_an_error_with_the_nearest_names(config, where, suggested):
    with pytest.raises(
        ValueError, match=rf"unknown key in {where}, one neither artnb nor ART has .*did you mean {suggested}"
    ):
        resolve(config)


@pytest.mark.parametrize(
    ("config", "said"),
    [
        (
            {"engine_args": {"max_num_seq": 8}},
            "engine_args.max_num_seq is accepted .*if you meant 'max_num_seqs'",
        ),
        ({"trainer_args": {"sed": 1}}, "trainer_args.sed is accepted .*if you meant 'seed'"),
    ],
)
def test_a_near_miss_in_engine_or_trainer_args_is_named_in_the_warning(config, said):
    """These sections take vLLM's and TRL's own options in ART (gradient_checkpointing_kwargs is one, near
    gradient_checkpointing), so a near miss is said, not refused."""
    with pytest.warns(UserWarning, match=said):
        resolve(config)


def test_keys_art_has_and_artnb_does_not_use_are_still_reported_as_ignored():
    config = {
        "init_args": {"fast_inference": True},
        "engine_args": {
            "enable_sleep_mode": True,
            "compilation_config": {"level": 3},
        },  # the latter: vLLM's, newer
        "trainer_args": {
            "gradient_checkpointing_kwargs": {}
        },  # close to gradient_checkpointing, but ART's own
        "chat_template_content_format": "openai",
        "chat_template_tool_schema_format": "vllm_openai",
    }
    with pytest.warns(UserWarning) as caught:
        resolve(config)
    messages = " ".join(str(w.message) for w in caught)
    for name in (
        "init_args.fast_inference",
        "engine_args.enable_sleep_mode",
        "engine_args.compilation_config",
        "trainer_args.gradient_checkpointing_kwargs",
        "_internal_config.chat_template_content_format",
        "_internal_config.chat_template_tool_schema_format",
    ):
        assert f"{name} is accepted for ART compatibility but ignored" in messages, name


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("4k", TypeError),
        (None, TypeError),
        (4096.5, TypeError),
        (0, ValueError),
        (-5, ValueError),
        (15, ValueError),
    ],
)
def test_max_seq_length_must_be_a_whole_number_of_at_least_16_tokens(value, error):
    with pytest.raises(
        error, match=rf"{INIT_MSL} must be a whole number of tokens >= 16 \(got {value!r}\); pass e.g. 4096"
    ):
        resolve({"init_args": {"max_seq_length": value}})


def test_max_seq_length_16_is_the_smallest_accepted_and_a_whole_float_is_a_whole_number():
    assert resolve({"init_args": {"max_seq_length": 16}}).max_seq_length == 16
    assert resolve({"init_args": {"max_seq_length": 8e3}}).max_seq_length == 8000


@pytest.mark.parametrize("section", ["init_args", "engine_args", "trainer_args", "peft_args", "lora_config"])
@pytest.mark.parametrize("value", [[("max_seq_length", 4096)], "enforce_eager"])
def test_a_section_that_is_not_a_dict_names_the_key(section, value):
    with pytest.raises(
        TypeError, match=rf'_internal_config\["{section}"\] must be a dict \(got {type(value).__name__}'
    ):
        resolve({section: value})


def test_use_gradient_checkpointing_takes_bools_and_unsloth():
    for value, expected in ((True, True), (False, False), ("unsloth", True)):
        settings = resolve({"init_args": {"use_gradient_checkpointing": value}})
        assert settings.trainer["gradient_checkpointing"] is expected


@pytest.mark.parametrize(
    ("section", "key", "value", "error", "said"),
    [
        ("init_args", "use_gradient_checkpointing", "false", ValueError,
         r'must be True, False or "unsloth" \(got \'false\'\); pass the bool False'),
        ("trainer_args", "gradient_checkpointing", "false", TypeError, "must be True or False"),
        ("init_args", "load_in_4bit", "false", TypeError, "must be True or False"),  # bool("false") is True
        ("trainer_args", "seed", "abc", TypeError, r"must be a whole number \(got 'abc'\)"),
        ("engine_args", "max_num_seqs", 0, ValueError, "must be a whole number >= 1"),
    ],
)  # fmt: skip
def test_a_value_of_the_wrong_type_or_range_is_named_as_written(section, key, value, error, said):
    where = rf'_internal_config\["{section}"\]\["{key}"\]'
    with pytest.raises(error, match=rf"{where} {said}"):
        resolve({section: {key: value}}, on_cuda=True)


@pytest.mark.parametrize("on_cuda", [False, True])
@pytest.mark.parametrize(("value", "error"), [("high", TypeError), (0, ValueError), (1.5, ValueError)])
def test_gpu_memory_utilization_must_be_a_fraction_up_to_1(on_cuda, value, error):
    for section in ("engine_args", "init_args"):
        where = rf'_internal_config\["{section}"\]\["gpu_memory_utilization"\]'
        with pytest.raises(
            error, match=rf"{where} must be a fraction of GPU memory in \(0, 1\] \(got {value!r}\)"
        ):
            resolve({section: {"gpu_memory_utilization": value}}, on_cuda=on_cuda)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        settings = resolve({"engine_args": {"gpu_memory_utilization": 1}}, on_cuda=on_cuda)
    assert settings.gpu_overrides == ({"gpu_memory_utilization": 1.0} if on_cuda else {})


@pytest.mark.parametrize("config", ["x", [1], ("init_args",)])
def test_internal_config_that_is_not_a_dict_says_to_pass_one(config):
    with pytest.raises(
        TypeError, match=r"_internal_config takes a dict \(got .*\); pass art.dev.InternalModelConfig\("
    ):
        resolve(config)
    with pytest.raises(TypeError, match="_internal_config takes a dict"):
        check_internal_config(config)
    with pytest.raises(
        TypeError, match="_internal_config takes a dict"
    ):  # where it is given, not at register
        art.TrainableModel(name="m", project="p", base_model="x", _internal_config=config)


def test_an_art_config_still_resolves_silently():
    config = art.dev.InternalModelConfig(
        init_args=art.dev.InitArgs(max_seq_length=4096, use_gradient_checkpointing="unsloth", random_state=7),
        engine_args=art.dev.EngineArgs(enforce_eager=True, max_num_seqs=8, gpu_memory_utilization=0.8),
        lora_config=art.dev.LoRAConfig(rank=16, alpha=32),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        settings = resolve(config, on_cuda=True)
    assert settings.max_seq_length == 4096 and settings.lora == {"r": 16, "alpha": 32}
    assert check_internal_config(config) == config and check_internal_config(None) is None


def test_unsloths_and_vllms_own_values_are_not_mistaken_for_typos():
    """load_in_fp8 is Unsloth's (near load_in_8bit); max_logprobs=-1 is vLLM's "no cap"."""
    with pytest.warns(UserWarning, match="init_args.load_in_fp8 is accepted"):
        resolve({"init_args": {"load_in_fp8": True}})
    assert "--max-logprobs" in resolve({"engine_args": {"max_logprobs": -1}}).vllm_args


TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_chat_template_and_its_kwargs_are_honoured_not_reported(tmp_path):
    kwargs = {"enable_thinking": False, "tags": ["a", {"b": 1.5}], "none": None}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing here is "accepted ... but ignored"
        settings = resolve({"chat_template_kwargs": kwargs, "chat_template": TEMPLATE})
        assert (settings.chat_template, settings.chat_template_kwargs) == (TEMPLATE, kwargs)
        path = tmp_path / "chat_template.jinja"
        path.write_text(TEMPLATE)
        assert resolve({"chat_template_path": str(path)}).chat_template == TEMPLATE
        assert resolve({"chat_template_path": path, "chat_template_kwargs": None}).chat_template_kwargs == {}
    assert resolve({}).chat_template is None and resolve({"init_args": {}}).chat_template_kwargs == {}


@pytest.mark.parametrize(
    ("kwargs", "error", "said"),
    [
        (["enable_thinking"], TypeError, r"must be a dict of template variables \(got list"),
        ({1: True}, TypeError, r"keys must be strings, the template variables' names \(got 1\)"),
        ({"when": object()}, TypeError, r'\["when"\] = <object .* is not JSON-serialisable'),
        ({"x": float("nan")}, TypeError, r'\["x"\] = nan is not JSON-serialisable'),
        ({"add_generation_prompt": False}, ValueError, "an argument of apply_chat_template itself"),
        (
            {"chat_template": TEMPLATE},
            ValueError,
            r'pass the template as _internal_config\["chat_template"\]',
        ),
    ],
)
def test_bad_chat_template_kwargs_are_refused_at_register(kwargs, error, said):
    with pytest.raises(error, match=r'_internal_config\["chat_template_kwargs"\].*' + said):
        resolve({"chat_template_kwargs": kwargs})


def test_bad_chat_templates_are_refused_at_register(tmp_path):
    with pytest.raises(
        TypeError, match=r'_internal_config\["chat_template"\] must be the template text, a str'
    ):
        resolve({"chat_template": ["{{ x }}"]})
    with pytest.raises(ValueError, match="chat template is empty"):
        resolve({"chat_template": " \n"})
    with pytest.raises(
        ValueError,
        match=r'_internal_config\["chat_template"\]: the chat template does not parse \(jinja2, line 2',
    ):
        resolve({"chat_template": "{% for m in messages %}\n{{ m.content }}{% endfor"})
    missing = tmp_path / "missing.jinja"
    with pytest.raises(
        ValueError, match=r"chat_template_path.*missing.jinja.* could not be read \(FileNotFound"
    ):
        resolve({"chat_template_path": str(missing)})
    with pytest.raises(ValueError, match=r"could not be read \(IsADirectoryError"):
        resolve({"chat_template_path": str(tmp_path)})
    with pytest.raises(TypeError, match="pass the path of a chat template file"):
        resolve({"chat_template_path": 3})
    missing.write_text(TEMPLATE)
    with pytest.raises(ValueError, match='has both "chat_template" and "chat_template_path": pass one'):
        resolve({"chat_template": TEMPLATE, "chat_template_path": str(missing)})
