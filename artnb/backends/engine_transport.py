"""The HTTP transport behind `model.openai_client()` on LocalBackend: every request reaches the model's engine
as it is now, serving the newest committed step.

Why not a plain client on the engine's URL: an engine that died is restarted on a new port with a new key, and
clients made before the restart stay in users' hands (in notebook variables, in rollout closures). The transport
looks the engine up per request, restarts a dead one first, loads a newer committed step first, and keeps one
connection pool per model that every client of the model shares (the backend closes it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx

from .served import ServedModel


class EngineDiedError(RuntimeError):
    """The inference engine process exited; the next request or train call restarts it."""


class EngineTransport(httpx.AsyncBaseTransport):
    """Forwards requests to the engine of the slot `lookup()` returns (the model's, while it is registered)."""

    def __init__(self, lookup: Callable[[], ServedModel]) -> None:
        self.lookup = lookup
        self.inner = _connection_pool()
        self.port: int | None = None  # the engine the pool's connections lead to
        self.loop: asyncio.AbstractEventLoop | None = None  # the event loop they belong to

    def _on_this_loop(self) -> None:
        """A script that calls asyncio.run once per phase gives each phase a new event loop: the connections the
        last one opened cannot be used, or closed, from this one. A fresh pool; the old one's sockets close when
        it is collected."""
        loop = asyncio.get_running_loop()
        if self.loop is not loop:
            if self.loop is not None:
                self.inner, self.port = _connection_pool(), None
            self.loop = loop

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self._on_this_loop()
        served = self.lookup()
        if not served.engine_current():
            await served.ensure_engine()
        # A restarted engine has a new port and key; a client made before the restart still reaches it.
        port = httpx.URL(served.engine.base_url).port
        if port != self.port:
            # The pool's kept-alive connections lead to the engine that died: they never serve again, and an
            # idle one is never noticed closed, so each restart would leave a socket open (found by the soak).
            old, self.inner, self.port = self.inner, _connection_pool(), port
            await old.aclose()
        if request.url.port != port:
            request.url = request.url.copy_with(port=port)
        request.headers["Authorization"] = f"Bearer {served.engine.api_key}"
        try:
            return await self.inner.handle_async_request(request)
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as exc:
            if not served.engine.alive():
                raise EngineDiedError(
                    f"the inference engine for {served.model.name!r} exited (code {served.engine.returncode}) "
                    f"while serving this request; see its log in {served.store.logs}. The next request restarts "
                    "it."
                ) from exc
            raise

    async def aclose(self) -> None:
        """A client closing leaves the pool to the backend: other clients of the same model share it."""

    async def close_pool(self) -> None:
        self._on_this_loop()
        await self.inner.aclose()


def _connection_pool() -> httpx.AsyncHTTPTransport:
    return httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100))
