"""The layers meet at named contracts: each implementation provides everything its Protocol lists."""

from __future__ import annotations

import artnb as art
from artnb import models
from artnb.backends.engines.hf.client import HFEngine
from artnb.backends.engines.vllm.client import VLLMEngine
from artnb.backends.trainers.peft_trainer import PeftTrainer
from artnb.core.contracts import Backend, Engine, Trainer


def test_local_backend_is_a_backend(tmp_path):
    assert isinstance(art.LocalBackend(path=tmp_path), Backend)


def test_engines_are_engines(tmp_path):
    tiny = models.tiny()
    assert isinstance(HFEngine(tiny, "base", tmp_path), Engine)
    assert isinstance(VLLMEngine(tiny, "base", tmp_path), Engine)


def test_peft_trainer_is_a_trainer():
    assert isinstance(PeftTrainer(models.tiny(), art.LoRAConfig(r=2)), Trainer)


def test_a_model_only_reaches_its_backend_through_the_contract():
    """core/model.py calls these backend methods and no others."""
    import ast
    import inspect

    import artnb.core.model as model_module

    tree = ast.parse(inspect.getsource(model_module))
    called = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Call)
        and getattr(node.value.func, "attr", None) == "_require_backend"
    }
    called |= {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "_backend"
    }
    contract = {name for name in [*vars(Backend), *Backend.__annotations__] if not name.startswith("_")}
    assert called and called <= contract, called - contract
