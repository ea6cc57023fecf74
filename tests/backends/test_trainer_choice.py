"""Which trainer LocalBackend builds, and what it says: the decision for every machine, and this CPU's for real."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import artnb as art
from artnb.backends.trainers import choice
from artnb.backends.trainers.choice import choose_trainer, make_trainer
from artnb.backends.trainers.peft_trainer import PeftTrainer
from artnb.backends.trainers.unsloth_trainer import unsloth_problem
from artnb.core.config import LoRAConfig, TrainerConfig

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _say_afresh(monkeypatch):
    monkeypatch.setattr(choice, "_said", set())


def test_auto_picks_unsloth_on_cuda_where_it_imports():
    assert choose_trainer("auto", on_cuda=True, unsloth_problem=None) == (
        "unsloth",
        "trainer='auto' uses Unsloth: there is a CUDA GPU and `import unsloth` works",
    )


def test_auto_falls_back_to_peft_and_says_why():
    kind, why = choose_trainer(
        "auto", on_cuda=True, unsloth_problem="Unsloth is not installed: pip install x"
    )
    assert (
        kind == "peft"
        and why == "trainer='auto' uses PEFT, not Unsloth: Unsloth is not installed: pip install x"
    )
    kind, why = choose_trainer("auto", on_cuda=False, unsloth_problem="no GPU")
    assert kind == "peft" and "no CUDA GPU" in why


def test_explicit_choices():
    assert choose_trainer("peft", on_cuda=True, unsloth_problem=None)[0] == "peft"
    assert choose_trainer("unsloth", on_cuda=True, unsloth_problem=None)[0] == "unsloth"
    with pytest.raises(RuntimeError, match=r"trainer='unsloth'\): broken wheel\. Use trainer='peft'"):
        choose_trainer("unsloth", on_cuda=True, unsloth_problem="broken wheel")
    assert choose_trainer("fsdp", on_cuda=False, unsloth_problem="no GPU") == (
        "fsdp",
        "trainer='fsdp' was asked for",
    )
    with pytest.raises(ValueError, match="choose 'auto', 'peft', 'unsloth' or 'fsdp'"):
        choose_trainer("trl", on_cuda=True, unsloth_problem=None)


def test_on_this_cpu_unsloth_is_refused_with_the_reason_and_never_imported():
    problem = unsloth_problem()
    assert problem == "Unsloth needs an NVIDIA GPU (CUDA) and this machine has none"
    with pytest.raises(RuntimeError, match="needs an NVIDIA GPU .* Use trainer='peft'"):
        art.LocalBackend(trainer="unsloth")
    with pytest.raises(ValueError, match="trainer='trl'"):
        art.LocalBackend(trainer="trl")
    assert "unsloth" not in sys.modules


def test_auto_builds_peft_here_and_says_so_once(caplog):
    base = art.models.tiny()
    with caplog.at_level(logging.INFO, logger="artnb"):
        first = make_trainer("auto", base, LoRAConfig(r=2), TrainerConfig())
        make_trainer("auto", base, LoRAConfig(r=2), TrainerConfig())
    assert type(first) is PeftTrainer
    said = [r.getMessage() for r in caplog.records if "trainer='auto'" in r.getMessage()]
    assert said == ["artnb: trainer='auto' uses PEFT: this machine has no CUDA GPU, which Unsloth needs"]


def test_import_artnb_loads_neither_unsloth_nor_vllm():
    code = (
        "import sys, artnb\n"
        "import artnb.backends.trainers.unsloth_trainer, artnb.backends.trainers.choice, artnb.backends.gpu_presets\n"
        "heavy = {'unsloth', 'unsloth_zoo', 'vllm', 'bitsandbytes'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=env)


def test_peft_with_a_4bit_preset_warns_that_16_bits_may_not_fit():
    from artnb.backends.gpu_presets import CARDS, QWEN2_5, choose_preset

    preset = choose_preset(CARDS["T4"], QWEN2_5["3B"])
    assert preset.load_in_4bit
    with pytest.warns(
        UserWarning, match="T4 preset .* takes Unsloth; the PEFT trainer loads them in 16 bits"
    ):
        trainer = make_trainer("peft", art.models.tiny(), LoRAConfig(r=2), TrainerConfig(), preset)
    assert type(trainer) is PeftTrainer
