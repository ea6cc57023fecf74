"""Weave with artnb, as ART's notebooks use it: rollouts decorated with `@weave.op` train with Weave not
initialised; `init_weave` against a W&B server that is down or silent warns once, within its bound, and the loop
goes on; `strip_logprobs` as Weave's output hook keeps logprobs out of what Weave sends (its own HTTP client,
to a recording server on 127.0.0.1)."""

from __future__ import annotations

import json
import socket
import threading
import time
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import weave
from openai.types.chat.chat_completion import Choice
from tiny_loop import pick
from weave.trace import weave_client
from weave.trace.context import weave_client_context
from weave.trace_server_bindings.remote_http_trace_server import RemoteHTTPTraceServer

import artnb as art
from artnb.integrations.weave_init import init_weave
from artnb.models import tiny
from artnb.utils import strip_logprobs

BASE = tiny(hidden_size=64, num_layers=2, seed=1)


@weave.op
async def rollout(model: art.TrainableModel, seed: int) -> art.Trajectory:
    return await pick(model.openai_client(), model, seed)


async def train_a_step(model: art.TrainableModel) -> art.TrainResult:
    groups = await art.gather_trajectory_groups(
        art.TrajectoryGroup(rollout(model, 10 * g + i) for i in range(4)) for g in range(2)
    )
    assert all(isinstance(t, art.Trajectory) and t.trainable_turns() == 1 for g in groups for t in g)
    for g in groups:  # something to learn whatever the tiny model samples
        g.trajectories[0].reward, g.trajectories[1].reward = 1.0, 0.0
    return await model.train(groups, config=art.TrainConfig(learning_rate=1e-2))


@pytest.fixture(scope="module")
async def model(tmp_path_factory):
    backend = art.LocalBackend(path=tmp_path_factory.mktemp("weave"), engine="hf")
    model = art.TrainableModel(name="agent", project="weave", base_model=BASE)
    await model.register(backend)
    yield model
    await backend.close()


@pytest.fixture
def no_weave():
    assert weave_client_context.get_weave_client() is None
    yield
    weave_client_context.set_weave_client_global(None)


async def test_weave_ops_train_without_weave_init(no_weave, model):
    step = await model.get_step()
    assert (await train_a_step(model)).step == step + 1


@pytest.mark.parametrize("server", ["down", "silent"])
async def test_init_weave_without_a_reachable_server_warns_and_the_loop_goes_on(
    server, no_weave, monkeypatch, model
):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    if server == "silent":
        listener.listen(16)  # connections are queued, never answered
    port = listener.getsockname()[1]
    if server == "down":
        listener.close()
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        started = time.monotonic()
        client = init_weave("weave-down", timeout_s=2, global_postprocess_output=strip_logprobs)
        took = time.monotonic() - started
    assert client is None and took < 3
    [warning] = [str(w.message) for w in caught if "weave.init" in str(w.message)]
    assert f"127.0.0.1:{port}" in warning and "tracing is off" in warning
    assert ("within 2 s" if server == "silent" else "Connection refused") in warning

    step = await model.get_step()
    assert (await train_a_step(model)).step == step + 1
    listener.close()


class RecordingTraceServer:
    """What Weave's own HTTP binding (`RemoteHTTPTraceServer`) sends, kept by a server on 127.0.0.1 that answers
    every request with a digest (all that object, file and call uploads need back)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, bytes]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                owner.requests.append((self.path, self.rfile.read(int(self.headers["Content-Length"] or 0))))
                data = json.dumps({"digest": f"digest-{len(owner.requests)}"}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def calls(self) -> list[dict]:
        """The call records Weave uploaded, as JSON: whole calls (`calls/complete`) or their start and end
        halves (`call/upsert_batch`, older servers)."""
        found = []
        for path, body in self.requests:
            if "/call" in path:
                data = json.loads(body)
                for item in data["batch"] if "batch" in data else [data]:
                    item = item.get("req", item)
                    found.append(item.get("end") or item.get("start") or item)
        return found

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_strip_logprobs_keeps_logprobs_out_of_weave_traces(no_weave):
    """Weave's own op, serialization and HTTP upload code; only the trace server is a local recorder."""
    recorder = RecordingTraceServer()
    client = weave_client.WeaveClient(
        "entity",
        "project",
        RemoteHTTPTraceServer(recorder.url, should_batch=True),
        ensure_project_exists=False,
        postprocess_output=strip_logprobs,
    )
    weave_client_context.set_weave_client_global(client)

    @weave.op
    def scored(logprob: float) -> art.Trajectory:
        token = {"token": "A", "logprob": logprob, "bytes": [65], "top_logprobs": []}
        choice = Choice.model_validate(
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": "A"},
                "logprobs": {"content": [token]},
            }
        )
        return art.Trajectory(
            messages_and_choices=[{"role": "user", "content": "Which?"}, choice], reward=1.0
        )

    try:
        trajectory = scored(-0.123)
        client.flush()
    finally:
        recorder.close()
    assert trajectory.messages_and_choices[1].logprobs.content[0].logprob == -0.123  # training keeps them
    [output] = [c["output"] for c in recorder.calls() if c.get("output") is not None]
    assert output["_type"] == "Trajectory" and output["messages_and_choices"][0]["content"] == "Which?"
    sent = output["messages_and_choices"][1]
    assert sent["message"]["content"] == "A" and sent["logprobs"] is None
