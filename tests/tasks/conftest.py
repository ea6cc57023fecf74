"""A real HF engine serving the tiny random model, shared by the task rollout tests of one session."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

import artnb as art
from artnb import models
from artnb.backends.engines.hf.client import HFEngine


@pytest.fixture(scope="session")
def tiny_path() -> str:
    return models.tiny()


@pytest.fixture(scope="session")
async def tiny_model(tiny_path, tmp_path_factory) -> art.Model:
    """An `art.Model` (not trainable) pointed at an HF engine serving the tiny model as "base"."""
    engine = HFEngine(
        tiny_path, "base", tmp_path_factory.mktemp("engine-logs"), device="cpu", max_batch_size=16
    )
    await engine.start(timeout=120)
    yield art.Model(name="base", inference_base_url=engine.base_url, inference_api_key=engine.api_key)
    await engine.stop()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_path):
    return AutoTokenizer.from_pretrained(tiny_path)
