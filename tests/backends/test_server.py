"""`artnb serve` as a process on 127.0.0.1: the key on every route, the body limit, the bind refusal; the wire
format's round trip; the inference proxy's pass-through (in process, over a stand-in engine).

The server here registers no trainable model, so it starts in seconds; training over it is in
test_remote_backend.py.
"""

from __future__ import annotations

import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from openai.types.chat.chat_completion import Choice
from transformers import AutoTokenizer

import artnb as art
from artnb.backends.local import LocalBackend
from artnb.backends.ports import free_port
from artnb.backends.remote import RemoteBackend
from artnb.backends.server import ArtnbServer, check_bind, create_app, is_loopback
from artnb.core.gather import AfterEachFailure, GatheredGroups
from artnb.core.tokenize import tokenize_groups
from artnb.core.trajectory import ExceptionRecord
from artnb.core.wire import (
    config_to_wire,
    dumps,
    groups_from_wire,
    groups_to_wire,
    loads,
    model_from_wire,
    model_to_wire,
    result_from_wire,
    result_to_wire,
    train_config_from_wire,
)
from artnb.models import tiny

KEY = "test-key-0123456789"
LIMIT = 2**20  # the server below refuses bodies over 1 MiB

# Every route, with sample path parameters. The test below checks the app has no route missing from here.
ROUTES = [
    ("GET", "/info"),
    ("POST", "/models/p/agent/register"),
    ("GET", "/models/p/agent/step"),
    ("POST", "/models/p/agent/train"),
    ("POST", "/models/p/agent/train_sft"),
    ("POST", "/models/p/agent/log"),
    ("POST", "/models/p/agent/delete_checkpoints"),
    ("POST", "/models/p/agent/default_temperature"),
    ("POST", "/models/p/agent/fork"),
    ("POST", "/models/p/agent/push_to_s3"),
    ("POST", "/models/p/agent/pull_from_s3"),
    ("GET", "/models/p/agent/files"),
    ("GET", "/models/p/agent/history"),
    ("GET", "/models/p/agent/trajectories/train/0"),
    ("GET", "/models/p/agent/v1/models"),
    ("POST", "/models/p/agent/v1/chat/completions"),
]


def serve_command(path: Path, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "artnb.cli", "serve", "--path", str(path), "--port", str(port), *extra]


def wait_for_health(url: str, process: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"artnb serve exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"artnb serve did not answer in {timeout} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`artnb serve` with a key (from the environment) and a 1 MiB body limit."""
    tmp = tmp_path_factory.mktemp("serve")
    port, log = free_port(), tmp / "server.log"
    env = {**os.environ, "ARTNB_API_KEY": KEY}
    with open(log, "wb") as out:
        process = subprocess.Popen(
            serve_command(
                tmp / "runs",
                port,
                "--max-request-bytes",
                str(LIMIT),
                "--engine",
                "hf",
                "--trainer-config",
                '{"seed": 3}',
                "--gpu-cost-per-hour-usd",
                "2.5",
            ),  # fmt: skip
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, process, log)
        yield url
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)


def test_health_is_open_and_every_other_route_needs_the_key(server):
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for method, path in ROUTES:
            response = httpx.request(method, server + path, headers=headers, content=b"{}")
            assert response.status_code == 401, (method, path, headers, response.text)
            assert "ARTNB_API_KEY" in response.json()["error"]["message"]
    info = httpx.get(f"{server}/info", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert info["max_request_bytes"] == LIMIT and info["wire"] == 1
    assert (info["trainer"], info["trainer_config"]) == ("auto", {"seed": 3})  # --trainer-config reached it
    assert info["gpu_cost_per_hour_usd"] == 2.5
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert httpx.get(server + path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 404


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--trainer-config", '{"placment": "split"}'), "placment"),  # pydantic names the unknown field
        (("--trainer-config", '["split"]'), "give a JSON object of art.TrainerConfig fields"),
        (
            ("--trainer-config", '{"placement": "split"}'),
            r"trainer='auto' is not the FSDP trainer: use .*trainer='fsdp'",
        ),
        (("--gpu-cost-per-hour-usd", "-2"), r"gpu_cost_per_hour_usd=-2.0: pass the machine's price"),
        (("--gpu-cost-per-hour-usd", "nan"), r"gpu_cost_per_hour_usd=nan: .* a number >= 0"),
        (("--port", "99999"), r"--port 99999: pass a TCP port from 1 to 65535"),  # was: served on 34463
        (("--max-request-bytes", "-5"), r"--max-request-bytes -5: pass a positive number"),
        (("--engine-options", "[1]"), r"--engine-options \[1\]: give a JSON object"),
        (("--path", __file__), r"--path .*is a file, not a directory"),
    ],
)
def test_a_bad_setting_stops_artnb_serve_before_it_listens(tmp_path, flags, message):
    done = subprocess.run(
        serve_command(tmp_path, free_port(), *flags),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and re.search(message, done.stderr), done.stderr


def test_the_route_list_above_is_every_route_of_the_app(tmp_path):
    app = create_app(LocalBackend(path=tmp_path), api_key=KEY).app
    served = {(method, route.path) for route in app.routes for method in route.methods}
    served -= {("HEAD", r.path) for r in app.routes}
    templates = {
        (m, p.replace("/p/agent/", "/{project}/{name}/").replace("/train/0", "/{split}/{step}"))
        for m, p in ROUTES
    }
    proxied = "/models/{project}/{name}/v1/{path:path}"
    templates = {(m, proxied if "/v1/" in p else p) for m, p in templates}
    assert {r for r in served if r[1] != "/health"} - {(m, proxied) for m in ("PUT", "PATCH", "DELETE")} == (
        templates | {("GET", proxied), ("POST", proxied)}
    )


def test_a_body_over_the_limit_gets_413_before_it_is_read(server):
    with socket.create_connection(("127.0.0.1", int(server.rsplit(":", 1)[1]))) as s:
        s.sendall(
            b"POST /models/p/agent/log HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + KEY.encode()
            + f"\r\nContent-Length: {LIMIT + 1}\r\n\r\n".encode()
        )  # and no body: the answer comes without it
        s.settimeout(30)
        reply = b""
        while chunk := s.recv(65536):  # the server closes the connection after its answer
            reply += chunk
        reply = reply.decode()
    assert reply.startswith("HTTP/1.1 413") and "connection: close" in reply.lower()
    assert f"limit of {LIMIT} bytes" in reply


async def test_remote_backend_refuses_a_batch_over_the_servers_limit_before_sending(server, tmp_path):
    backend = RemoteBackend(server, api_key=KEY, path=tmp_path / "mirror")
    judge = art.Model(name="judge", project="p")  # a comparison model: registering it starts nothing
    await judge.register(backend)
    huge = art.Trajectory(messages_and_choices=[{"role": "user", "content": "x" * LIMIT}], reward=1.0)
    with pytest.raises(ValueError, match=r"over the server's limit of 1\.0 MiB; nothing was sent"):
        await judge.log([art.TrajectoryGroup([huge, huge])], split="val")
    row = await judge.log([art.TrajectoryGroup([huge.model_copy(update={"messages_and_choices": []})] * 2)])
    assert row["val/reward"] == 1.0
    assert list(judge.history()["val/reward"]) == [1.0]  # written on the server, read from the mirror
    await backend.close()


async def test_a_wrong_key_is_a_clear_error_in_the_notebook(server, tmp_path):
    backend = RemoteBackend(server, api_key="wrong", path=tmp_path)
    with pytest.raises(PermissionError, match="refused the API key.*ARTNB_API_KEY"):
        await art.Model(name="judge", project="p").register(backend)


def test_binding_beyond_loopback_without_a_key_is_refused(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "ARTNB_API_KEY"}
    done = subprocess.run(
        serve_command(tmp_path, free_port(), "--host", "0.0.0.0"), env=env, capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "refusing to serve on '0.0.0.0' without an API key" in done.stderr and "--api-key" in done.stderr
    assert not (tmp_path / "p").exists()
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert is_loopback(host)
        check_bind(host, None)
    for host in ("0.0.0.0", "::", "10.0.0.5", "gpu-box"):
        assert not is_loopback(host)
        with pytest.raises(ValueError, match="without an API key"):
            check_bind(host, None)
        check_bind(host, "a key")


# the wire format ---------------------------------------------------------------------------------------------
def sampled(tokenizer, text: str, first_logprob: float) -> Choice:
    """A Choice as an engine returns it: logprobs per token and the sampled token ids (ending with EOS)."""
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    return Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": text},
            "logprobs": {
                "content": [
                    {"token": tokenizer.decode([i]), "logprob": first_logprob / (k + 1), "top_logprobs": []}
                    for k, i in enumerate(ids)
                ]
            },
            "token_ids": ids,
        }
    )


def test_a_batch_sent_and_received_trains_to_the_same_tokens():
    tokenizer = AutoTokenizer.from_pretrained(tiny(hidden_size=64, num_layers=2, seed=1))
    tools = [{"type": "function", "function": {"name": "move", "parameters": {"type": "object"}}}]

    def trajectory(i: int) -> art.Trajectory:
        t = art.Trajectory(
            messages_and_choices=[
                {"role": "system", "content": "Play."},
                {"role": "user", "content": f"Board {i}: ünïcode ✓"},
                sampled(tokenizer, f"I move to {i}", -0.1 * (i + 1)),
                {"role": "user", "content": "Again?"},
                sampled(tokenizer, "Yes", -1 / 3),
            ],
            tools=tools,
            reward=i / 3,
            metrics={"win": i % 2 == 0, "moves": i, "nan": math.nan},
            metadata={"seed": i, "name": f"game {i}"},
            logs=[f"log {i}"],
            additional_histories=[
                art.History(
                    messages_and_choices=[
                        {"role": "user", "content": "Sub?"},
                        sampled(tokenizer, "Sub", -2.0),
                    ]
                )
            ],
        )
        return t

    groups = GatheredGroups(
        [
            art.TrajectoryGroup(
                [trajectory(i) for i in (0, 1, 3)],
                exceptions=[ExceptionRecord(type="ValueError", message="bad", traceback="tb")],
                metadata={"scenario": np.int64(7), "obj": object.__name__},
                metrics={"group_m": 0.5},
                logs=["group log"],
            ),
            art.TrajectoryGroup([trajectory(i) for i in (3, 0)]),
        ],
        [AfterEachFailure(group_index=2, error=ExceptionRecord(type="E", message="m", traceback=""))],
    )
    received = groups_from_wire(loads(dumps(groups_to_wire(groups))))

    assert isinstance(received, GatheredGroups) and received.after_each_failures == groups.after_each_failures
    choice = received[0][1].messages_and_choices[2]
    assert (
        isinstance(choice, Choice)
        and choice.model_dump() == groups[0][1].messages_and_choices[2].model_dump()
    )
    assert received[0][1].messages_and_choices[0] == {"role": "system", "content": "Play."}
    assert isinstance(received[0][0].additional_histories[0].messages_and_choices[1], Choice)
    assert received[0].exceptions == groups[0].exceptions and received[0].logs == ["group log"]
    assert received[0].metadata == {"scenario": 7, "obj": "object"}
    t, r = groups[0][2], received[0][2]
    assert (r.reward, r.tools, r.metadata, r.logs) == (t.reward, t.tools, t.metadata, t.logs)
    assert math.isnan(r.metrics.pop("nan")) and r.metrics == {"win": False, "moves": 3}

    before = tokenize_groups(tokenizer, groups)
    after = tokenize_groups(tokenizer, received)
    assert len(before.sequences) == len(after.sequences) == 5 * 2  # each with its additional history
    for a, b in zip(before.sequences, after.sequences, strict=True):
        assert a.token_ids == b.token_ids and a.assistant_mask == b.assistant_mask
        assert a.advantage == b.advantage and sum(a.assistant_mask) > 0
        assert np.array_equal(np.array(a.logprobs), np.array(b.logprobs), equal_nan=True)


def test_configs_results_and_models_cross_the_wire_as_they_were():
    config = art.TrainConfig(learning_rate=1e-3, beta=0.1)
    again = train_config_from_wire(loads(dumps(config_to_wire(config))))
    assert again == config and again.model_fields_set == config.model_fields_set  # unset stays unset
    result = art.TrainResult(step=3, metrics={"train/loss": math.nan, "n": 2}, checkpoint_path="/c/0003")
    back = result_from_wire(loads(dumps(result_to_wire(result))))
    assert back.step == 3 and math.isnan(back.metrics["train/loss"]) and back.metrics["n"] == 2

    model = art.TrainableModel(
        name="agent", project="p", base_model="b", _internal_config={"engine_args": {"max_model_len": 512}}
    )
    model.inference_api_key = "secret"
    wire = model_to_wire(model)
    assert "secret" not in dumps(wire).decode() and "base_path" not in wire["fields"]
    served = model_from_wire(loads(dumps(wire)))
    assert isinstance(served, art.TrainableModel) and served._internal_config == model._internal_config
    gpt = art.Model(name="gpt", project="p", inference_base_url="https://api", inference_api_key="sk-secret")
    assert "sk-secret" not in dumps(model_to_wire(gpt)).decode()
    assert model_from_wire(loads(dumps(model_to_wire(gpt)))).inference_base_url == "https://api"


# the inference proxy, in process over a stand-in engine ---------------------------------------------------------
class StandInBackend:
    """What ArtnbServer uses of a LocalBackend for proxying: a path and `http_client(model)` to its engine."""

    def __init__(self, path: Path) -> None:
        self.path, self.engine, self.seen = path, "hf", []

    def http_client(self, model):
        async def engine(request: httpx.Request) -> httpx.Response:
            self.seen.append(request)

            async def events():
                for i in range(3):
                    yield f"data: {i}\n\n".encode()
                yield b"data: [DONE]\n\n"

            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())

        return httpx.AsyncClient(transport=httpx.MockTransport(engine))


async def test_the_proxy_streams_through_and_refuses_what_is_not_inference(tmp_path):
    backend = StandInBackend(tmp_path)
    server = ArtnbServer(backend, api_key=KEY, max_request_bytes=LIMIT)
    model = art.TrainableModel(name="agent", project="p", base_model="b")
    model.inference_base_url = "http://127.0.0.1:1/v1"
    server.models[("p", "agent")] = model
    transport = httpx.ASGITransport(server.app())
    async with httpx.AsyncClient(
        transport=transport, base_url="http://s", headers={"Authorization": f"Bearer {KEY}"}
    ) as client:
        response = await client.post(
            "/models/p/agent/v1/chat/completions?x=1", json={"model": "agent", "stream": True}
        )
        assert response.status_code == 200 and response.headers["content-type"] == "text/event-stream"
        assert response.text == "data: 0\n\ndata: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
        sent = backend.seen[-1]
        assert str(sent.url) == "http://127.0.0.1:1/v1/chat/completions?x=1"
        assert "authorization" not in sent.headers  # the engine's own key is set by LocalBackend's transport
        assert loads(sent.content) == {"model": "agent", "stream": True}

        refused = await client.post("/models/p/agent/v1/load_lora_adapter", json={})
        assert refused.status_code == 403 and "loads each committed step's adapter" in refused.text
        for sneaky in ("../artnb/hold", "./load_lora_adapter", "chat/%2E%2E/%2E%2E/artnb/hold"):
            response = await client.post(f"/models/p/agent/v1/{sneaky}", json={})
            assert response.status_code in (400, 403, 404), sneaky  # 403, 404: the client removed the dots
        assert response.status_code == 400 and "'..'" in response.text  # decoded on the server, refused there
        assert len(backend.seen) == 1  # none of these reached the engine
        unknown = await client.post("/models/p/other/v1/chat/completions", json={})
        assert unknown.status_code == 404 and unknown.headers["x-artnb-error"] == "model-not-registered"
        bad = await client.get("/models/p/..%2F..%2Fetc/files")
        assert bad.status_code in (400, 404)
        bad_split = await client.get("/models/p/agent/trajectories/..%2Fx/0")
        assert bad_split.status_code in (400, 404)
