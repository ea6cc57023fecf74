"""The door of both engine servers and of `artnb serve`: the API key and the request-size limit, checked before
a body is read; and `while_connected`, which stops a request's work when its client goes away.

Why a pure ASGI layer rather than a FastAPI dependency: FastAPI reads and parses a request's body before its
dependencies run, so an auth check written as a dependency still lets anyone make the server read, buffer
and parse a 48 MB body. Here:

- the key comes from the headers alone and is compared in constant time (`secrets.compare_digest` on bytes),
  so a wrong key is answered 401 before a byte of body is read, and the answer's timing says nothing about
  how much of the key was right;
- a body whose Content-Length is over the limit is answered 413 before it is read; a chunked body (no
  length) is counted as it arrives and answered 413 once it passes the limit;
- both refusals close the connection, since the unread body would otherwise be parsed as the next request.

`RequestGuard` wraps the HF engine's whole app; vLLM's `ServerMiddleware` (vllm/server.py) calls `refusal`
and `BodyLimit` itself, since it also admits and rewrites requests. Only `/health` stays open (for readiness
checks) and the server's own lifespan events (`open_to_all`): a CORS preflight (OPTIONS) needs the key like any
request, and a websocket without it is closed before it is accepted (`refuse_websocket`).
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, TypeVar

T = TypeVar("T")

DEFAULT_MAX_REQUEST_BYTES = 32 * 2**20  # a 2048-token chat is ~10 kB; 32 MiB leaves room for long contexts
MAX_REQUEST_BYTES_ENV = "ARTNB_MAX_REQUEST_BYTES"  # how VLLMEngine hands the limit to ServerMiddleware

# ASGI's types, as starlette spells them (this module does not import it)
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyTooLarge(Exception):
    """Raised by `BodyLimit.receive` once the body passed the limit; the 413 has already been sent."""


def open_to_all(scope: Scope) -> bool:
    """What passes without the key: the server's own lifespan events and GET-style probes of `/health`."""
    return scope["type"] == "lifespan" or (scope["type"] == "http" and scope["path"] == "/health")


async def refuse_websocket(receive: Receive, send: Send) -> None:
    """Close a websocket before accepting it (the client sees HTTP 403): artnb's servers take none without the
    key, and serve none with it."""
    await receive()  # websocket.connect
    await send({"type": "websocket.close", "code": 1008, "reason": "missing or wrong API key"})


def header(scope: Scope, name: bytes) -> bytes:
    """The first value of header `name` (lower case), or b''."""
    return next((v for k, v in scope["headers"] if k == name), b"")


def too_large_message(limit: int, size: int | None) -> str:
    """Why a body of `size` bytes (None: chunked, size unknown) was refused, and what to do."""
    body = f"the request body ({size} bytes)" if size is not None else "the chunked request body"
    return (
        f"{body} is over this engine's limit of {limit} bytes: send a smaller request, or start the engine "
        f"with a larger max_request_bytes (HFEngine/VLLMEngine option)"
    )


def refusal(
    scope: Scope, api_key: str | None, max_request_bytes: int, key_source: str
) -> tuple[int, str] | None:
    """(401, why) for a missing or wrong key, (413, why) for a Content-Length over the limit, else None.

    `key_source` tells the client where the right key lives, e.g. "HFEngine.api_key". `api_key=None` checks
    only the size (`artnb serve` on 127.0.0.1 started without a key).
    """
    if api_key is not None and not secrets.compare_digest(
        header(scope, b"authorization"), f"Bearer {api_key}".encode()
    ):
        return 401, (
            f"missing or wrong API key: send 'Authorization: Bearer <key>' with the key this engine was started "
            f"with ({key_source})"
        )
    length = header(scope, b"content-length")
    if length.isdigit() and int(length) > max_request_bytes:
        return 413, too_large_message(max_request_bytes, int(length))
    return None


async def send_json(send: Send, status: int, content: dict[str, Any], *, close: bool = False) -> None:
    """One complete JSON response; `close` asks the server to drop the connection after it."""
    body = json.dumps(content).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def error_body(status: int, message: str) -> dict[str, Any]:
    """OpenAI's error body `{"error": {"message", "type", "code"}}`: the openai client raises it, message intact."""
    kind = {401: "authentication_error", 404: "not_found_error"}.get(status, "invalid_request_error")
    kind = "internal_error" if status >= 500 else kind
    return {"error": {"message": message, "type": kind, "code": status}}


async def send_error(send: Send, status: int, message: str, *, close: bool = False) -> None:
    await send_json(send, status, error_body(status, message), close=close)


class BodyLimit:
    """Wraps one request's `receive` and `send`: past `max_bytes` of body it answers 413 and raises BodyTooLarge.

    After the 413, whatever the app still sends is dropped (the client has its answer). An app that answered
    before reading all of the body gets no 413, only the exception.
    """

    def __init__(self, receive: Receive, send: Send, max_bytes: int):
        self._receive, self._send, self.max_bytes = receive, send, max_bytes
        self.received = 0
        self.refused = False
        self.responding = False  # the app started its response

    async def receive(self) -> Message:
        if self.refused:
            raise BodyTooLarge
        message = await self._receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.max_bytes:
                self.refused = True
                if not self.responding:
                    await send_error(self._send, 413, too_large_message(self.max_bytes, None), close=True)
                raise BodyTooLarge
        return message

    async def send(self, message: Message) -> None:
        if not self.refused:
            self.responding = self.responding or message["type"] == "http.response.start"
            await self._send(message)


class RequestGuard:
    """Pure ASGI middleware: every route but `/health` needs the key; bodies over `max_request_bytes` get 413.

    >>> app = RequestGuard(fastapi_app, api_key="k", max_request_bytes=2**20, key_source="HFEngine.api_key")
    """

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_request_bytes: int, key_source: str):
        if api_key is not None and not api_key:  # None is an explicit "no key"; "" is a mistake
            raise ValueError("RequestGuard needs a non-empty api_key: an empty key would let anyone in")
        self.app, self.api_key, self.max_request_bytes = app, api_key, max_request_bytes
        self.key_source = key_source

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if open_to_all(scope):
            return await self.app(scope, receive, send)
        refused = refusal(scope, self.api_key, self.max_request_bytes, self.key_source)
        if scope["type"] == "websocket":
            return await (refuse_websocket(receive, send) if refused else self.app(scope, receive, send))
        if refused is not None:
            return await send_error(send, *refused, close=True)
        limit = BodyLimit(receive, send, self.max_request_bytes)
        try:
            await self.admitted(scope, limit.receive, limit.send)
        except Exception:
            if not limit.refused:  # after a 413 the app may fail any way it likes: the client has its answer
                raise

    async def admitted(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Where a request that passed the guard goes: the app (vLLM's middleware routes it first)."""
        await self.app(scope, receive, send)


class ClientGone(Exception):
    """The client disconnected before its request was answered."""


async def while_connected(request: Any, work: Awaitable[T]) -> T:
    """Await `work`, unless the client disconnects first: then cancel it and raise ClientGone.

    The body was already read, so the next message `receive()` gives is the disconnect.
    """

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watch):
            if not pending.done():
                pending.cancel()
    if watch.done() and not watch.cancelled():
        await asyncio.gather(
            task, return_exceptions=True
        )  # let it unwind (e.g. the HF engine marks its rows cancelled)
        raise ClientGone
    return task.result()
