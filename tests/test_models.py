"""The embedded model's tokenizer is SmolLM2's whichever transformers converted it: conversions that read the GGUF
differently are repaired or refused, and a cached copy from another converter is checked before use."""

import json
import shutil

import pytest
from transformers import AutoTokenizer

from artnb import models


@pytest.fixture(scope="module")
def converted():
    return models.embedded_model_path()


def test_the_converted_tokenizer_encodes_as_smollm2_does(converted):
    tokenizer = AutoTokenizer.from_pretrained(converted)
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|im_end|>")
    assert tokenizer("Hello world")["input_ids"] == [19556, 905]  # no BOS on plain text
    manifest = json.loads((converted / "artnb-manifest.json").read_text())
    assert manifest["format"] == 2 and manifest["transformers"] == models._transformers_version()


def test_a_wrong_end_token_is_repaired(converted):
    tokenizer = AutoTokenizer.from_pretrained(converted)
    tokenizer.eos_token = "<|im_start|>"  # how transformers 5.6-5.17 read the GGUF
    assert models._checked_tokenizer(tokenizer).eos_token == "<|im_end|>"


def test_a_tokenizer_that_encodes_differently_is_refused(converted):
    tokenizer = AutoTokenizer.from_pretrained(converted)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(RuntimeError, match="reads the embedded model's tokenizer wrongly.*pip install"):
        models._checked_tokenizer(tokenizer)


def copy_of(converted, tmp_path, name="copy", **manifest_changes):
    copy = tmp_path / name
    shutil.copytree(converted, copy, ignore=shutil.ignore_patterns("model.safetensors"))
    manifest = json.loads((copy / "artnb-manifest.json").read_text())
    manifest["files"].pop("model.safetensors")
    manifest.update(manifest_changes)
    (copy / "artnb-manifest.json").write_text(json.dumps(manifest))
    return copy


def test_a_copy_from_before_the_check_is_converted_again(converted, tmp_path):
    assert models._embedded_ok(copy_of(converted, tmp_path))
    old = copy_of(converted, tmp_path, "old")
    manifest = json.loads((old / "artnb-manifest.json").read_text())
    del manifest["format"]
    (old / "artnb-manifest.json").write_text(json.dumps(manifest))
    assert not models._embedded_ok(old)


def test_a_copy_saved_by_another_transformers_is_read_back_and_checked(converted, tmp_path):
    copy = copy_of(converted, tmp_path, transformers="5.0.0")
    assert models._embedded_ok(copy)  # its tokenizer reads back as SmolLM2's
    tokenizer = json.loads((copy / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"]["Hello"], tokenizer["model"]["vocab"]["ĠBye"] = 905, 19556
    (copy / "tokenizer.json").write_text(json.dumps(tokenizer))
    models._reads_back.cache_clear()
    assert not models._embedded_ok(copy)  # the next use converts again
