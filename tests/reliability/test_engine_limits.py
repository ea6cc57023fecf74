"""The HF engine's limits as a client meets them: one real server process on the tiny model, real HTTP.

A huge prompt must not freeze the server, a client that leaves must not keep the model busy, an
unauthenticated or oversized body must be refused before it is read, every route but /health needs the key,
a request's own chat template is refused, and a hung engine makes control calls time out with a clear error.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
import time
from collections.abc import Iterable

import httpx
import openai
import pytest
import websockets
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocket, WebSocketDisconnect

from artnb import models
from artnb.backends.engines.guard import RequestGuard
from artnb.backends.engines.hf.client import HFEngine
from artnb.backends.engines.hf.protocol import ChatRequest
from artnb.backends.engines.hf.server import HFServer, create_app

LIMIT = 8 * 2**20  # the engine's max_request_bytes: above the 4 MB prompt, below what the tests send
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
async def engine(tmp_path_factory):
    engine = HFEngine(
        models.tiny(), "base", tmp_path_factory.mktemp("logs"), device="cpu", max_request_bytes=LIMIT
    )
    await engine.start()  # its default limit (300 s): a loaded machine needed more than 120 s
    yield engine
    await engine.stop()


@pytest.fixture(scope="module")
def client(engine) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=engine.base_url, api_key=engine.api_key, max_retries=0)


def root(engine: HFEngine) -> str:
    return engine.base_url.removesuffix("/v1")


def raw_post(port: int, headers: dict[str, str], body: Iterable[bytes] = ()) -> tuple[int, str, float]:
    """POST /v1/chat/completions over a plain socket, sending `body` from a thread while the answer is read.

    Returns (status, whole response text, seconds until the answer began). The socket lets a test announce a
    body it never sends, and keep sending after the server answered, which an HTTP client does not allow.
    """
    head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": "127.0.0.1", **headers}.items())
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        started = time.monotonic()
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\n{head}\r\n".encode())

        def pump() -> None:
            try:
                for chunk in body:
                    sock.sendall(chunk)
            except OSError:
                pass  # the server answered and closed the connection

        threading.Thread(target=pump, daemon=True).start()
        response = sock.recv(65536)
        answered = time.monotonic() - started
        while not complete(response) and (data := sock.recv(65536)):
            response += data
    return int(response.split(b" ", 2)[1]), response.decode(errors="replace"), answered


def complete(response: bytes) -> bool:
    """Whether a raw HTTP response has arrived whole (headers, and as much body as its Content-Length says).

    The server may reset the connection right after a refusal (it did not read what was sent), so the test
    reads exactly the response rather than until the connection closes.
    """
    head, blank, body = response.partition(b"\r\n\r\n")
    if not blank:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value)
    raise AssertionError(f"no Content-Length in {response!r}")


async def wait_for_stats(engine: HFEngine, ready, timeout: float = 10) -> dict:
    deadline = time.monotonic() + timeout
    while not ready(stats := await engine.stats()):
        assert time.monotonic() < deadline, f"stats never got there: {stats}"
        await asyncio.sleep(0.02)
    return stats


async def test_a_huge_prompt_gets_a_400_while_health_stays_responsive(engine):
    """Tokenizing 4 MB takes seconds; it runs off the event loop, so /health keeps answering meanwhile."""
    prompt = [{"role": "user", "content": "hello world " * (4_000_000 // 12)}]
    latencies: list[float] = []
    done = threading.Event()

    def poll_health() -> None:
        with httpx.Client(timeout=30) as http:
            while not done.is_set():
                started = time.monotonic()
                assert http.get(f"{root(engine)}/health").status_code == 200
                latencies.append(time.monotonic() - started)
                time.sleep(0.02)

    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            started = time.monotonic()
            response = await http.post(
                f"{engine.base_url}/chat/completions",
                json={"model": "base", "messages": prompt, "max_tokens": 4},
                headers={"Authorization": f"Bearer {engine.api_key}"},
            )
            took = time.monotonic() - started
    finally:
        done.set()
        poller.join()
    assert response.status_code == 400, response.text
    assert "shorten the conversation" in response.json()["error"]["message"]
    assert len(latencies) >= 5, f"the big request took {took:.2f}s: too short to overlap the polls"
    assert max(latencies) < 0.5, f"/health took {max(latencies):.2f}s while a 4 MB prompt was tokenized"


async def test_a_client_that_disconnects_stops_its_decoding(engine, client):
    long = {"model": "base", "messages": HELLO, "max_tokens": 1900, "min_tokens": 1900}  # seconds to decode
    before = await engine.stats()
    async with httpx.AsyncClient(timeout=60) as http:
        headers = {"Authorization": f"Bearer {engine.api_key}"}
        request = asyncio.create_task(
            http.post(f"{engine.base_url}/chat/completions", json=long, headers=headers)
        )
        await wait_for_stats(engine, lambda s: s["running"] == 1)
        await asyncio.sleep(0.3)
        request.cancel()  # closes the connection, as a client that gives up does
        gone = time.monotonic()
        after = await wait_for_stats(engine, lambda s: s["aborted_rows"] > before["aborted_rows"], timeout=5)
        stopped = time.monotonic() - gone
    assert after["running"] == 0 and after["aborted_rows"] == before["aborted_rows"] + 1
    assert stopped < 2, f"decoding went on for {stopped:.1f}s after the client left"
    # the engine is free again: the next request runs alone (how fast depends on the machine's load)
    assert (await client.chat.completions.create(model="base", messages=HELLO, max_tokens=4)).choices
    assert (await engine.stats())["aborted_rows"] == after["aborted_rows"]


async def test_queued_rows_of_a_client_that_left_never_run(engine):
    before = await engine.stats()
    await engine.hold()
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            headers = {"Authorization": f"Bearer {engine.api_key}"}
            body = {"model": "base", "messages": HELLO, "max_tokens": 4, "n": 3}
            request = asyncio.create_task(
                http.post(f"{engine.base_url}/chat/completions", json=body, headers=headers)
            )
            await wait_for_stats(engine, lambda s: s["requests"] > before["requests"])
            request.cancel()
            await asyncio.sleep(0.3)  # the server sees the disconnect while the rows wait for release
    finally:
        await engine.release()
    after = await wait_for_stats(engine, lambda s: s["dropped_rows"] >= before["dropped_rows"] + 3)
    assert after["dropped_rows"] == before["dropped_rows"] + 3 and after["rows"] == before["rows"]


async def test_oversized_and_unauthenticated_bodies_are_refused_before_they_are_read(engine, client):
    announced = {"Content-Type": "application/json", "Content-Length": str(48 * 2**20)}
    # No body is ever sent: an answer at all proves the server did not wait to read it.
    status, text, answered = raw_post(engine.port, announced)
    assert status == 401 and "API key" in text and answered < 2
    status, text, answered = raw_post(engine.port, {**announced, "Authorization": "Bearer wrong"})
    assert status == 401 and answered < 2
    status, text, answered = raw_post(engine.port, {**announced, "Authorization": f"Bearer {engine.api_key}"})
    assert status == 413 and f"limit of {LIMIT} bytes" in text and "max_request_bytes" in text
    assert answered < 2
    # Chunked, with no length to check up front: refused once LIMIT bytes have arrived.
    chunk = b"x" * 2**18
    chunked = (b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(2 * LIMIT // len(chunk)))
    headers = {"Authorization": f"Bearer {engine.api_key}", "Transfer-Encoding": "chunked"}
    status, text, _ = raw_post(engine.port, headers, chunked)
    assert status == 413 and "chunked" in text
    assert (await client.chat.completions.create(model="base", messages=HELLO, max_tokens=2)).choices


@pytest.fixture(scope="module")
def server() -> HFServer:
    """The engine's model and app in this process, to list its routes and render templates directly."""
    return HFServer(models.tiny(), "base", device="cpu", max_batch_size=1, max_loras=1)


async def test_every_route_but_health_needs_the_key_and_there_are_no_docs(engine, server):
    routes = [
        (method, route.path)
        for route in create_app(server, "key").app.routes
        for method in sorted(route.methods - {"HEAD"})
    ]
    paths = {path for _, path in routes}
    assert {"/health", "/v1/models", "/v1/chat/completions", "/artnb/hold", "/v1/load_lora_adapter"} <= paths
    assert not paths & {"/docs", "/redoc", "/openapi.json"}
    probes = [*routes, ("GET", "/docs"), ("GET", "/redoc"), ("GET", "/openapi.json"), ("GET", "/nope")]
    probes += [("OPTIONS", "/v1/chat/completions"), ("OPTIONS", "/v1/models")]  # CORS preflights too
    async with httpx.AsyncClient(base_url=root(engine), timeout=10) as http:
        for method, path in probes:
            key = engine.api_key
            for auth in (None, "Bearer wrong", f"Bearer {key[:-1]}", f"Bearer {key}x", key, f"Basic {key}"):
                headers = {"Authorization": auth} if auth is not None else {}
                status = (await http.request(method, path, headers=headers)).status_code
                assert status == (200 if path == "/health" else 401), (method, path, auth, status)
        for path in ("/docs", "/redoc", "/openapi.json"):
            response = await http.get(path, headers={"Authorization": f"Bearer {engine.api_key}"})
            assert response.status_code == 404, path
    assert not (await engine.stats())["held"], "a refused /artnb/hold must not hold"


async def test_a_websocket_without_the_key_is_closed_before_it_is_accepted(engine):
    url = root(engine).replace("http://", "ws://")
    for path, headers in [("/v1/chat/completions", {}), ("/health", {"Authorization": "Bearer wrong"})]:
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with websockets.connect(f"{url}{path}", additional_headers=headers, open_timeout=10):
                pass
        assert refused.value.response.status_code == 403, path


def test_the_guard_refuses_a_websocket_the_app_would_accept():
    """An app with a websocket route (vLLM has /v1/realtime): without the key the guard closes it first."""

    async def echo(socket: WebSocket) -> None:
        await socket.accept()
        await socket.send_text("open")
        await socket.close()

    guarded = RequestGuard(
        Starlette(routes=[WebSocketRoute("/ws", echo)]),
        api_key="k",
        max_request_bytes=1024,
        key_source="test",
    )
    with TestClient(guarded) as client:
        with client.websocket_connect("/ws", headers={"Authorization": "Bearer k"}) as socket:
            assert socket.receive_text() == "open"
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            with (
                pytest.raises(WebSocketDisconnect) as closed,
                client.websocket_connect("/ws", headers=headers),
            ):
                pass
            assert closed.value.code == 1008


async def test_a_path_like_adapter_name_is_refused_where_it_enters(engine, tmp_path):
    headers = {"Authorization": f"Bearer {engine.api_key}"}
    async with httpx.AsyncClient(base_url=root(engine), timeout=10) as http:
        for name in ("../x", "a/b", "x@-1"):
            body = {"lora_name": name, "lora_path": str(tmp_path)}
            response = await http.post("/v1/load_lora_adapter", json=body, headers=headers)
            assert response.status_code == 400, name
            assert "is not allowed" in response.json()["error"]["message"], name


async def test_a_request_chat_template_is_refused_unless_trusted(client, server):
    template = "{% for m in messages %}{{ m['content'] }}!{% endfor %}"
    for extra in ({"chat_template": template}, {"chat_template_kwargs": {"chat_template": template}}):
        with pytest.raises(openai.BadRequestError, match="trust_request_chat_template=True"):
            await client.chat.completions.create(model="base", messages=HELLO, max_tokens=2, extra_body=extra)
    other_kwargs = {"chat_template_kwargs": {"enable_thinking": False}}  # template variables still pass
    assert (
        await client.chat.completions.create(
            model="base", messages=HELLO, max_tokens=2, extra_body=other_kwargs
        )
    ).choices
    server.trust_request_chat_template = True
    try:
        prompt, _ = server.rows_for(ChatRequest(model="base", messages=HELLO, chat_template=template))
    finally:
        server.trust_request_chat_template = False
    assert server.tokenizer.decode(prompt) == "Say hello.!"


async def test_control_calls_to_a_stopped_engine_time_out_with_a_clear_error(engine, client, tmp_path):
    with pytest.raises(ValueError, match="control_timeout_s=0: pass a positive number"):
        HFEngine(models.tiny(), "base", tmp_path, control_timeout_s=0)
    engine.control_timeout_s = engine.hold_timeout_s = 1
    os.kill(engine.pid, signal.SIGSTOP)
    try:
        with pytest.raises(TimeoutError) as error:
            await engine.stats()
        message = str(error.value)
        assert "HF engine" in message and "GET /artnb/stats" in message and "within 1s" in message
        assert str(engine.log_path) in message and "control_timeout_s" in message
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="POST /artnb/hold within 1s"):
            await engine.hold()
        assert time.monotonic() - started < 5  # the hold's limit, then a short best-effort release
    finally:
        os.kill(engine.pid, signal.SIGCONT)
        engine.control_timeout_s, engine.hold_timeout_s = 60, 900
    await asyncio.sleep(0.5)  # the stopped calls are still queued in the server; their clients left
    assert (await client.chat.completions.create(model="base", messages=HELLO, max_tokens=2)).choices
    assert not (await engine.stats())["held"], "a hold whose client timed out must not stay held"
