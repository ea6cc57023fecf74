"""Langfuse traces from a real training loop: the real Langfuse SDK sends to a small HTTP server on 127.0.0.1
that speaks the endpoints the SDK calls (OTLP/HTTP protobuf spans, the scores batch, the project lookup) and
keeps what it got. Also: a Langfuse host that is down costs a training step nothing but one warning, and
without keys Langfuse is never imported."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import subprocess
import sys
import threading
import time
import uuid
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from tiny_loop import gather, pick

import artnb as art
from artnb.integrations import langfuse_traces
from artnb.models import tiny
from artnb.widgets import TrainingPanel

BASE = tiny(hidden_size=64, num_layers=2, seed=1)
PROJECT_ID = "proj-1"


class FakeLangfuse:
    """The endpoints Langfuse's SDK calls, on 127.0.0.1: spans (OTLP/HTTP protobuf) and scores are decoded and
    kept; the project lookup names project PROJECT_ID."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.scores: list[dict] = []
        self.paths: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                owner.paths.append(self.path)
                if self.path.startswith("/api/public/projects"):
                    project = {"id": PROJECT_ID, "name": "p", "organization": {"id": "o", "name": "o"}}
                    return self._reply(200, {"data": [{**project, "metadata": {}}]})
                self._reply(404, {})

            def do_POST(self) -> None:
                owner.paths.append(self.path)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path == "/api/public/otel/v1/traces":
                    owner.spans += spans_of(body)
                    return self._reply(200, {})
                if self.path == "/api/public/scores":  # langfuse 5
                    owner.scores += json.loads(body)
                    return self._reply(202, {"message": "Accepted"})
                if self.path == "/api/public/ingestion":  # langfuse 3 sends scores as ingestion events
                    events = json.loads(body)["batch"]
                    owner.scores += [e["body"] for e in events if e["type"] == "score-create"]
                    return self._reply(
                        207, {"successes": [{"id": e["id"], "status": 201} for e in events], "errors": []}
                    )
                self._reply(404, {})

            def _reply(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def roots(self) -> list[dict]:
        return [s for s in self.spans if not s["parent"]]

    def generations(self) -> list[dict]:
        return [s for s in self.spans if s["attributes"].get("langfuse.observation.type") == "generation"]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def spans_of(body: bytes) -> list[dict]:
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    return [
        {
            "trace": span.trace_id.hex(),
            "id": span.span_id.hex(),
            "parent": span.parent_span_id.hex(),
            "name": span.name,
            "start": span.start_time_unix_nano,
            "end": span.end_time_unix_nano,
            "attributes": {a.key: _value(a.value) for a in span.attributes},
        }
        for resource in request.resource_spans
        for scope in resource.scope_spans
        for span in scope.spans
    ]


def _value(value):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


def decoded(value):
    """A metadata attribute: JSON-encoded by langfuse 5, the value itself (str or number) by langfuse 3."""
    try:
        return json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError:
        return value


@pytest.fixture
def langfuse(monkeypatch):
    server = FakeLangfuse()
    # the SDK keeps one client per public key for the whole process: each test gets its own key
    monkeypatch.setenv("LANGFUSE_PUBLIC_KEY", f"pk-lf-{uuid.uuid4().hex[:8]}")
    monkeypatch.setenv("LANGFUSE_SECRET_KEY", "sk-lf-test")
    monkeypatch.setenv("LANGFUSE_BASE_URL", server.url)
    monkeypatch.delenv("LANGFUSE_HOST", raising=False)
    monkeypatch.setattr(langfuse_traces, "_explicit", None)
    yield server
    server.close()


@pytest.fixture(scope="module")
async def served(tmp_path_factory):
    """One tiny model for the file: each test closes its reporters, so the next use chooses them anew."""
    backend = art.LocalBackend(path=tmp_path_factory.mktemp("langfuse"), engine="hf")
    model = art.TrainableModel(name="agent", project="lf", base_model=BASE)
    await model.register(backend)
    yield backend, model
    await backend.close()


async def test_a_training_loop_sends_traces_generations_and_scores(langfuse, served):
    backend, model = served
    groups = await gather(model, 0)
    # RULER as a user runs it: copies of the group's trajectories, the judge's score as reward, its explanation
    groups[1] = await art.ruler_score_group(groups[1], art.LocalJudge(BASE))
    result = await backend.train(model, groups, learning_rate=1e-2)
    await model.log(groups, split="train", metrics=result.metrics, step=result.step)  # merged: no new traces
    val = await gather(model, 1)
    await model.log(val, split="val")
    assert model.reporting.links() == [("Langfuse", f"{langfuse.url}/project/{PROJECT_ID}/traces")]
    panel = TrainingPanel(
        model, lambda m, seed: pick(m.openai_client(), m, seed), scenarios=[0], group_size=2
    )
    assert (
        f'<a href="{langfuse.url}/project/{PROJECT_ID}/traces" target="_blank">Langfuse</a>'
        in panel.status.value
    )
    await panel.wait()
    await asyncio.to_thread(model.reporting.close)  # as backend.close() does: the SDK sends what it holds
    deadline = time.monotonic() + 15
    while (len(langfuse.roots()) < 32 or len(langfuse.scores) < 32) and time.monotonic() < deadline:
        time.sleep(0.1)

    roots = langfuse.roots()
    names = sorted(r["attributes"]["langfuse.trace.name"] for r in roots)
    assert names == ["agent train step 0"] * 16 + ["agent val step 1"] * 16
    assert len({r["trace"] for r in roots}) == 32
    metadata = roots[0]["attributes"]
    assert decoded(metadata["langfuse.trace.metadata.project"]) == "lf"
    assert {"langfuse.trace.metadata.group", "langfuse.trace.metadata.step"} <= metadata.keys()

    # one generation per trainable turn, in its trajectory's trace, as the engine served it
    generations = langfuse.generations()
    by_trace = {r["trace"]: r for r in roots}
    assert len(generations) == 32
    for g in generations:
        root = by_trace[g["trace"]]
        assert g["parent"] == root["id"]
        step = root["attributes"]["langfuse.trace.name"].split()[-1]
        assert g["attributes"]["langfuse.observation.model.name"] == f"agent@{step}"
        usage = json.loads(g["attributes"]["langfuse.observation.usage_details"])
        assert (
            usage["input"] > 0 and usage["output"] > 0 and usage["total"] == usage["input"] + usage["output"]
        )
        assert decoded(g["attributes"]["langfuse.observation.metadata.recorded"]) is True  # RULER's copy too
        assert root["start"] <= g["start"] < g["end"] <= root["end"]
        output = json.loads(g["attributes"]["langfuse.observation.output"])
        assert output["role"] == "assistant" and "logprobs" not in output
        assert json.loads(g["attributes"]["langfuse.observation.input"])[-1]["content"] == "Which?"

    # scores: the reward of every trajectory, RULER's score with its explanation
    trace_of = {}  # (split, step, group, trajectory) -> trace id
    for r in roots:
        a = r["attributes"]
        key = [decoded(a[f"langfuse.trace.metadata.{k}"]) for k in ("split", "step", "group", "trajectory")]
        trace_of[tuple(str(k) for k in key)] = r["trace"]
    rewards = {s["traceId"]: s["value"] for s in langfuse.scores if s["name"] == "reward"}
    for split, step, batch in (("train", 0, groups), ("val", 1, val)):
        for g, group in enumerate(batch):
            for i, t in enumerate(group):
                assert rewards[trace_of[(split, str(step), str(g), str(i))]] == t.reward
    ruler = {s["traceId"]: s for s in langfuse.scores if s["name"] == "ruler_score"}
    assert set(ruler) == {trace_of[("train", "0", "1", str(i))] for i in range(8)}
    for i, t in enumerate(groups[1]):
        sent = ruler[trace_of[("train", "0", "1", str(i))]]
        assert sent["value"] == t.metrics["ruler_score"] == t.reward
        assert sent["comment"] == t.metadata["ruler_explanation"] and sent["comment"].startswith(
            "expected grade"
        )


@pytest.mark.parametrize("host", ["down", "silent"])
async def test_a_langfuse_host_that_is_down_or_silent_costs_a_step_at_most_one_warning(
    host, monkeypatch, served
):
    backend, model = served
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    if host == "silent":
        listener.listen(64)  # connections are queued, never answered
    port = listener.getsockname()[1]
    if host == "down":
        listener.close()
    monkeypatch.setattr(langfuse_traces, "CLOSE_TIMEOUT_S", 3.0)
    monkeypatch.delenv("LANGFUSE_PUBLIC_KEY", raising=False)
    monkeypatch.delenv("LANGFUSE_SECRET_KEY", raising=False)
    monkeypatch.setattr(langfuse_traces, "_explicit", None)
    langfuse_traces.enable_langfuse(
        public_key=f"pk-lf-{uuid.uuid4().hex[:8]}", secret_key="sk", host=f"http://127.0.0.1:{port}"
    )
    step = await model.get_step()
    groups = await gather(model, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        started = time.monotonic()
        result = await backend.train(model, groups, learning_rate=1e-2)
        await model.log(await gather(model, 1), split="val")
        took = time.monotonic() - started
        assert model.reporting.links() == []
        started = time.monotonic()
        await asyncio.to_thread(model.reporting.close)
        closing = time.monotonic() - started
    assert result.step == step + 1 and took < 30
    assert closing < langfuse_traces.CLOSE_TIMEOUT_S + 1
    messages = [str(w.message) for w in caught if "Langfuse" in str(w.message)]
    assert len(messages) == (1 if host == "down" else 0)  # a silent host shows once its lookup times out
    assert all(f"127.0.0.1:{port} is unreachable" in m and "Connection refused" in m for m in messages)
    listener.close()


def test_without_keys_langfuse_is_never_imported():
    code = (
        "import os, sys\n"
        "for k in ('LANGFUSE_PUBLIC_KEY', 'LANGFUSE_SECRET_KEY'): os.environ.pop(k, None)\n"
        "import artnb as art\n"
        "model = art.Model(name='m', inference_base_url='http://127.0.0.1:9/v1')\n"
        "model.openai_client()\n"
        "assert not any(r.name == 'Langfuse' for r in model.reporting.reporters())\n"
        "assert 'langfuse' not in sys.modules, 'langfuse was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
