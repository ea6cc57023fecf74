"""The httpx hook behind captured trajectories (capture.py): sees each model call an HTTP client sends.

Why httpx: the OpenAI SDK (and through it LangChain's ChatOpenAI, LangGraph, litellm's OpenAI route and the
OpenAI Agents SDK) sends every request through `httpx.Client.send` / `httpx.AsyncClient.send`, and the
Anthropic SDK through the same methods of httpx2 (pydantic's fork), whichever client object the user built, so
one hook on each sees them all. It is installed the
first time a capture scope opens, never at import, and it does nothing unless the calling context is inside a
scope: other requests pass through untouched. Chat completions are recorded as they are; OpenAI Responses-API
(`/v1/responses`) and Anthropic Messages (`/v1/messages`) calls are translated to chat first
(capture_protocols.py).

A non-streamed response is recorded when `send` returns (its body is read by then). A streamed one (`stream=True`)
is recorded when the client has read it to its end (`[DONE]`, `response.completed`, `message_stop`): the body is
teed as it is read and its server-sent events joined. A stream the client abandons half-way is not recorded (its
turn is incomplete). A compressed stream body (content-encoding) is not recorded either, with a warning: engines
and vLLM do not compress.
"""

from __future__ import annotations

import importlib
import json
import threading
import warnings
from collections.abc import AsyncIterator, Iterator
from types import ModuleType
from typing import Any

from . import capture_protocols as protocols
from .capture import capturing, record_chat
from .trajectory import Trajectory

_DONE = b"data: [DONE]"  # the last event of a whole stream
# httpx2 is pydantic's fork of httpx, with the same API: the Anthropic SDK, MCP and LangSmith send through it.
_MODULES = ("httpx", "httpx2")
_lock = threading.Lock()
_installed: set[str] = set()


def install() -> None:
    """Wrap the send methods of httpx (and httpx2, where installed) once per process."""
    with _lock:
        for name in _MODULES:
            if name in _installed:
                continue
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            _wrap(module)
            _installed.add(name)


def _wrap(http: ModuleType) -> None:
    sync_send, async_send = http.Client.send, http.AsyncClient.send
    tee = type("Tee", (_Tee, http.SyncByteStream, http.AsyncByteStream), {})

    def send(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        watch = _watched(http, request)
        response = sync_send(self, request, *args, **kwargs)
        if watch is not None:
            _record_when_read(http, tee, response, *watch)
        return response

    async def asend(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        watch = _watched(http, request)
        response = await async_send(self, request, *args, **kwargs)
        if watch is not None:
            _record_when_read(http, tee, response, *watch)
        return response

    http.Client.send = send
    http.AsyncClient.send = asend


def _endpoint(path: str) -> str | None:
    """Which API a request path calls: "chat", "responses" (OpenAI Responses) or "messages" (Anthropic)."""
    if path.endswith("/chat/completions"):
        return "chat"
    if path.endswith("/v1/responses"):
        return "responses"
    if path.endswith("/v1/messages"):
        return "messages"
    return None


def _watched(http: ModuleType, request: Any) -> tuple[Trajectory, dict[str, Any], str] | None:
    """(the trajectory, the request's JSON, its API) for a model call sent inside a capture scope; else None."""
    endpoint = _endpoint(request.url.path)
    if request.method != "POST" or endpoint is None:
        return None
    trajectory = capturing()
    if trajectory is None:
        return None
    try:
        body = json.loads(request.content)
    except (http.RequestNotRead, ValueError):
        return None
    return (trajectory, body, endpoint) if isinstance(body, dict) else None


def _record_when_read(
    http: ModuleType, tee: type, response: Any, trajectory: Trajectory, request: dict[str, Any], endpoint: str
) -> None:
    if response.status_code != 200:
        return
    try:
        body = response.content
    except (http.ResponseNotRead, http.StreamConsumed):
        encoding = response.headers.get("content-encoding", "identity")
        if encoding != "identity":
            warnings.warn(
                f"artnb: a model call streamed with content-encoding {encoding!r} was not captured into the "
                "trajectory; ask the server for an uncompressed stream or append the turn yourself",
                stacklevel=3,
            )
            return
        response.stream = tee(
            response.stream, lambda data, whole: _record(trajectory, request, endpoint, data, whole)
        )
        return
    _record(trajectory, request, endpoint, body)


def _record(
    trajectory: Trajectory, request: dict[str, Any], endpoint: str, body: bytes, whole: bool = True
) -> None:
    stream = bool(request.get("stream"))
    if endpoint == "chat" and not whole and not (stream and _DONE in body):
        return  # closed before the end: the turn is incomplete
    try:
        if endpoint == "chat":
            record_chat(trajectory, request, _from_events(body) if stream else json.loads(body))
        elif endpoint == "responses":
            response = protocols.response_from_events(body) if stream else json.loads(body)
            if request.get("previous_response_id"):
                warnings.warn(
                    "artnb: a Responses-API call with previous_response_id was captured without the earlier "
                    "turns the server kept: send the whole conversation as `input` to train on it in context",
                    stacklevel=2,
                )
            chat = {
                "messages": protocols.responses_messages(request),
                "tools": protocols.responses_tools(request),
            }
            record_chat(trajectory, chat, {"choices": [protocols.responses_choice(response)]})
        else:
            message = protocols.message_from_events(body) if stream else json.loads(body)
            chat = {
                "messages": protocols.anthropic_messages(request),
                "tools": protocols.anthropic_tools(request),
            }
            record_chat(trajectory, chat, {"choices": [protocols.anthropic_choice(message)]})
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        if whole:  # a stream closed half-way is an incomplete turn, not an error
            warnings.warn(f"artnb: a model call could not be captured ({error!r})", stacklevel=2)


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


class _Tee:
    """A response body passed through as the client reads it, handed whole to `done` once, when read to the end
    or closed (the OpenAI SDK closes a stream at `data: [DONE]` without reading on). Each HTTP module gets a
    subclass that is also its SyncByteStream and AsyncByteStream, the types its Response checks for."""

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
