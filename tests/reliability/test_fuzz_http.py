"""Fuzzed HTTP surfaces: schemathesis generates requests from the OpenAPI schema of the HF engine's routes (the
OpenAI-compatible ones and the control ones) and sends them to a real engine process on 127.0.0.1, with the
key and without it. Whatever the body: no 5xx, an answer within a bound, and nothing but /health answered
without the key. Bounded: 8 examples per route here (150 per route for the HF engine and 60 for `artnb serve` found nothing
when run by hand, 2026-11-26), seconds in all. `artnb serve` is fuzzed the same way with no model registered.

The schema is built in this process from the same app the engine serves (`create_app(...).app.openapi()`); the
served app has no docs routes (they would need the key anyway)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from artnb import models
from artnb.backends.engines.hf.client import HFEngine
from artnb.backends.engines.hf.server import HFServer, create_app
from artnb.backends.ports import free_port

EXAMPLES = 8  # per route, each sent four times (no key, two wrong ones, the key)
BOUND_S = 60  # no answer may take longer; generation is bounded by max_tokens and the tiny model's context
HOLDING = ("/artnb/hold",)
SERVE_KEY = "fuzz-key-0123456789"


def wait_until_up(root: str, process: subprocess.Popen, log, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"artnb serve exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{root}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(
        f"artnb serve did not answer in {timeout} s"
    )  # a hold makes generation wait for a release; it is released after each example


@pytest.fixture(scope="module")
async def engine(tmp_path_factory):
    engine = HFEngine(models.tiny(), "base", tmp_path_factory.mktemp("logs"), device="cpu")
    await engine.start()
    yield engine
    await engine.stop()


def engine_schema() -> schemathesis.BaseSchema:
    server = HFServer(models.tiny(), "base", device="cpu", max_batch_size=1, max_loras=1)
    return schemathesis.openapi.from_dict(create_app(server, "key").app.openapi())


def test_engine_routes_under_fuzzing(engine):
    root = engine.base_url.removesuffix("/v1")
    key = {"Authorization": f"Bearer {engine.api_key}"}
    schema = engine_schema()
    release = schema["/artnb/release"]["POST"]
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/load_lora_adapter", "/artnb/hold"}

    for operation in operations:

        @settings(
            max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None
        )
        @given(case=operation.as_strategy())
        def fuzz(case):
            expected = 200 if case.path == "/health" else 401
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": engine.api_key}):
                refused = case.call(base_url=root, headers=headers, timeout=BOUND_S)
                assert refused.status_code == expected, (case.path, headers, refused.text[:300])
            try:
                response = case.call(base_url=root, headers=key, timeout=BOUND_S)
            finally:
                if case.path in HOLDING:
                    release.Case().call(base_url=root, headers=key, timeout=BOUND_S)
            assert response.status_code < 500, (case.path, case.body, response.text[:500])

        fuzz()


def test_artnb_serve_routes_under_fuzzing(tmp_path):
    """`artnb serve` (no model registered): path parameters and bodies from its schema, with and without the key."""
    from artnb.backends.local import LocalBackend
    from artnb.backends.server import create_app as create_server_app

    schema = schemathesis.openapi.from_dict(
        create_server_app(LocalBackend(path=tmp_path), api_key="k").app.openapi()
    )
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "artnb.cli",
                "serve",
                "--path",
                str(tmp_path / "runs"),
                "--port",
                str(port),
            ]
            + ["--engine", "hf"],
            env={**os.environ, "ARTNB_API_KEY": SERVE_KEY},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    root = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(root, process, log)
        for result in schema.get_all_operations():
            operation = result.ok()

            @settings(
                max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None
            )
            @given(case=operation.as_strategy())
            def fuzz(case):
                expected = 200 if case.path == "/health" else 401
                refused = case.call(base_url=root, timeout=BOUND_S)
                assert refused.status_code == expected, (case.method, case.path, refused.text[:300])
                response = case.call(
                    base_url=root, headers={"Authorization": f"Bearer {SERVE_KEY}"}, timeout=BOUND_S
                )
                assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])

            fuzz()
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)
