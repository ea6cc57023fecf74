"""An HF engine serving a model for tests that call it as users do: through an `art.Model` pointing at it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import artnb as art
from artnb.backends.engines.hf.client import HFEngine


@contextlib.asynccontextmanager
async def served_model(model_path: str, logs: Path, **engine_options) -> AsyncIterator[art.Model]:
    """`model_path` served as "base" by a real HF engine process, as an `art.Model` (name "agent")."""
    engine = HFEngine(model_path, "base", logs, device="cpu", **engine_options)
    await engine.start(timeout=180)
    try:
        yield art.Model(
            name="agent",
            project="tests",
            inference_model_name="base",
            inference_base_url=engine.base_url,
            inference_api_key=engine.api_key,
        )
    finally:
        await engine.stop()
