"""The httpx hook behind captured trajectories (capture.py): sees each chat completion an HTTP client sends.

Why httpx: the OpenAI SDK (and through it LangChain's ChatOpenAI, LangGraph and litellm's OpenAI route) sends
every request through `httpx.Client.send` / `httpx.AsyncClient.send`, whichever client object the user built,
so one hook sees them all. It is installed the first time a capture scope opens, never at import, and it does
nothing unless the calling context is inside a scope: other requests pass through untouched.

A non-streamed response is recorded when `send` returns (its body is read by then). A streamed one (`stream=True`)
is recorded when the client has read it to its `[DONE]` event: the body is teed as it is read and its server-sent
chunks joined by streams.py. A stream the client abandons half-way is not recorded (its turn is incomplete). A compressed
stream body (content-encoding) is not recorded either, with a warning: engines and vLLM do not compress.
"""

from __future__ import annotations

import json
import threading
import warnings
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

from .capture import capturing, record_chat
from .trajectory import Trajectory

_DONE = b"data: [DONE]"  # the last event of a whole stream
_lock = threading.Lock()
_installed = False


def install() -> None:
    """Wrap httpx's send methods once per process."""
    global _installed
    with _lock:
        if _installed:
            return
        sync_send, async_send = httpx.Client.send, httpx.AsyncClient.send

        def send(self: httpx.Client, request: httpx.Request, *args: Any, **kwargs: Any) -> httpx.Response:
            watch = _watched(request)
            response = sync_send(self, request, *args, **kwargs)
            if watch is not None:
                _record_when_read(response, *watch)
            return response

        async def asend(
            self: httpx.AsyncClient, request: httpx.Request, *args: Any, **kwargs: Any
        ) -> httpx.Response:
            watch = _watched(request)
            response = await async_send(self, request, *args, **kwargs)
            if watch is not None:
                _record_when_read(response, *watch)
            return response

        httpx.Client.send = send  # type: ignore[method-assign]
        httpx.AsyncClient.send = asend  # type: ignore[method-assign]
        _installed = True


def _watched(request: httpx.Request) -> tuple[Trajectory, dict[str, Any]] | None:
    """(the trajectory, the request's JSON) for a chat completion sent inside a capture scope; else None."""
    if request.method != "POST" or not request.url.path.endswith("/chat/completions"):
        return None
    trajectory = capturing()
    if trajectory is None:
        return None
    try:
        body = json.loads(request.content)
    except (httpx.RequestNotRead, ValueError):
        return None
    return (trajectory, body) if isinstance(body, dict) else None


def _record_when_read(response: httpx.Response, trajectory: Trajectory, request: dict[str, Any]) -> None:
    if response.status_code != 200:
        return
    try:
        body = response.content
    except (httpx.ResponseNotRead, httpx.StreamConsumed):
        encoding = response.headers.get("content-encoding", "identity")
        if encoding != "identity":
            warnings.warn(
                f"artnb: a chat completion streamed with content-encoding {encoding!r} was not captured into the "
                "trajectory; ask the server for an uncompressed stream or append the turn yourself",
                stacklevel=3,
            )
            return
        response.stream = _Tee(response.stream, lambda data, whole: _record(trajectory, request, data, whole))
        return
    _record(trajectory, request, body)


def _record(trajectory: Trajectory, request: dict[str, Any], body: bytes, whole: bool = True) -> None:
    if not whole and not (request.get("stream") and _DONE in body):
        return  # closed before the end: the turn is incomplete
    try:
        completion = _from_events(body) if request.get("stream") else json.loads(body)
    except ValueError as error:
        warnings.warn(f"artnb: a chat completion could not be captured ({error})", stacklevel=2)
        return
    if isinstance(completion, dict):
        record_chat(trajectory, request, completion)


def _from_events(body: bytes) -> dict[str, Any]:
    """The ChatCompletion (as JSON) that a whole server-sent-event stream of chunks adds up to."""
    from openai.types.chat import ChatCompletionChunk

    from .streams import accumulate_chunks

    chunks = []
    for line in body.decode().splitlines():
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        event = json.loads(line[5:])
        if "error" in event:
            raise ValueError(f"the stream ended with an error: {event['error']}")
        chunks.append(ChatCompletionChunk.model_validate(event))
    return accumulate_chunks(chunks).model_dump(exclude_none=True)


class _Tee(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A response body passed through as the client reads it, handed whole to `done` once, when read to the end
    or closed (the OpenAI SDK closes a stream at `data: [DONE]` without reading on)."""

    def __init__(self, inner: Any, done: Any) -> None:
        self.inner, self.done, self.parts = inner, done, []
        self.finished = False

    def _finish(self, whole: bool) -> None:
        if not self.finished:
            self.finished = True
            self.done(b"".join(self.parts), whole)

    def __iter__(self) -> Iterator[bytes]:
        for part in self.inner:
            self.parts.append(part)
            yield part
        self._finish(whole=True)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for part in self.inner:
            self.parts.append(part)
            yield part
        self._finish(whole=True)

    def close(self) -> None:
        self.inner.close()
        self._finish(whole=False)

    async def aclose(self) -> None:
        await self.inner.aclose()
        self._finish(whole=False)
