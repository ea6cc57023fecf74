"""The HTTP transport behind `model.openai_client()` on LocalBackend: every request reaches the model's engine
as it is now, serving the newest committed step.

Why not a plain client on the engine's URL: an engine that died is restarted on a new port with a new key, and
clients made before the restart stay in users' hands (in notebook variables, in rollout closures). The transport
looks the engine up per request, restarts a dead one first, loads a newer committed step first, and keeps one
connection pool per model that every client of the model shares (the backend closes it). A request for an older
step the engine does not serve (`model.get_inference_name(step)` after a restart, e.g. the best checkpoint that
delete_checkpoints kept) loads that checkpoint from the run directory and is sent again.

A request that waits longer than the engine's `unanswered_s` (60 s) has the engine's /health checked, and again
each `unanswered_s` while it waits: an engine that does not answer (hung, or stopped, `kill -STOP`) is reported
once, with its log, instead of the request waiting out the client's 20-minute timeout in silence. It is left
running: a slow engine answers /health, so a missed check means something is wrong, yet killing it is the
user's call.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

import httpx

from ..core.contracts import Engine
from ..core.names import from_art_step
from .served import ServedModel

log = logging.getLogger("artnb")


class EngineDiedError(RuntimeError):
    """The inference engine process exited; the next request or train call restarts it."""


class NotRegisteredError(RuntimeError):
    """The model is not (or no longer) registered on the backend a client or call was made for."""


class EngineTransport(httpx.AsyncBaseTransport):
    """Forwards requests to the engine of the slot `lookup()` returns (the model's, while it is registered)."""

    def __init__(self, lookup: Callable[[], ServedModel]) -> None:
        self.lookup = lookup
        self.inner = _connection_pool()
        self.port: int | None = None  # the engine the pool's connections lead to
        self.loop: asyncio.AbstractEventLoop | None = None  # the event loop they belong to
        self.loading = asyncio.Lock()
        self.checked_at = 0.0  # when a waiting request last had the engine's /health checked
        self.reported: set[int] = set()  # ids of engines already reported as not answering

    def _on_this_loop(self) -> None:
        """A script that calls asyncio.run once per phase gives each phase a new event loop: the connections the
        last one opened cannot be used, or closed, from this one. A fresh pool; the old one's sockets close when
        it is collected."""
        loop = asyncio.get_running_loop()
        if self.loop is not loop:
            if self.loop is not None:
                self.inner, self.port, self.loading = _connection_pool(), None, asyncio.Lock()
            self.loop = loop

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self._on_this_loop()
        try:
            served = self.lookup()
        except NotRegisteredError as error:
            # an answer, not a transport failure: the OpenAI SDK then raises NotFoundError with this message
            # (for a raised error it retries, then says only "Connection error.")
            return httpx.Response(404, json={"error": {"message": str(error), "type": "not_registered"}})
        if not served.engine_current():
            try:
                await served.ensure_engine()
            except Exception as error:
                # an answer the SDK does not retry: each retry would start the engine again, and the SDK's
                # "Connection error." would hide why it could not
                return httpx.Response(
                    503,
                    headers={"x-should-retry": "false"},
                    json={"error": {"message": _unavailable(served, error), "type": "engine_unavailable"}},
                )
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
            response = await self._watched(served, request)
            if response.status_code == 404 and await self._load_named_checkpoint(served, request):
                await response.aclose()
                response = await self._watched(served, request)
            return response
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as exc:
            if not served.engine.alive():
                raise EngineDiedError(
                    f"the inference engine for {served.model.name!r} exited (code {served.engine.returncode}) "
                    f"while serving this request; see its log in {served.store.logs}. The next request restarts "
                    "it."
                ) from exc
            raise

    async def _watched(self, served: ServedModel, request: httpx.Request) -> httpx.Response:
        """The engine's response; while it is awaited, an engine that stops answering is reported."""
        engine, started = served.engine, time.monotonic()
        pending = asyncio.ensure_future(self.inner.handle_async_request(request))
        try:
            while not (await asyncio.wait([pending], timeout=engine.unanswered_s))[0]:
                await self._check(served, engine, time.monotonic() - started)
            return pending.result()
        finally:
            pending.cancel()  # a cancelled caller: the request goes too (a no-op once it is done)

    async def _check(self, served: ServedModel, engine: Engine, waited: float) -> None:
        """One health check per `unanswered_s` for all waiting requests; a silent engine reported once."""
        if time.monotonic() - self.checked_at < engine.unanswered_s or id(engine) in self.reported:
            return
        self.checked_at = time.monotonic()
        if engine.alive() and not await engine.answers(timeout_s=min(10.0, engine.unanswered_s)):
            self.reported.add(id(engine))
            log.warning(
                "artnb: a request to the inference engine for %r has waited %.0f s, and the engine does not "
                "answer its health check: it may be hung or stopped. Its log: %s. It is left running; if it "
                "stays so, `await backend.close()` and register again (or end its process: the next request "
                "restarts it)",
                served.model.name,
                waited,
                engine.log_path,
            )

    async def _load_named_checkpoint(self, served: ServedModel, request: httpx.Request) -> bool:
        """A request for `name@N` (or ART's `name:stepN`) that the engine does not serve, where checkpoint N is in
        the run directory (a best step kept by delete_checkpoints, after a restart): load it, True to resend."""
        if request.method != "POST":
            return False
        try:
            asked = json.loads(request.content).get("model")
        except (ValueError, AttributeError, httpx.RequestNotRead):
            return False
        name, _, step = from_art_step(asked).rpartition("@") if isinstance(asked, str) else ("", "", "")
        if name != served.model.name or not step.isdigit() or int(step) not in served.store.steps():
            return False
        adapter = f"{name}@{int(step)}"
        async with self.loading:  # rollouts in parallel asking for the same step: one load
            if adapter not in await self._served_names(served):
                try:
                    await served.engine.load_adapter(adapter, str(served.store.checkpoint_path(int(step))))
                except Exception:  # deleted meanwhile (delete_checkpoints), say: the engine's 404 stands
                    return False
                # the engine keeps a few adapters, evicting the first loaded: that may have been the newest
                if served.model.get_inference_name(served.step) not in await self._served_names(served):
                    served.newest_evicted()
        return True

    async def _served_names(self, served: ServedModel) -> set[str]:
        """What the engine serves now (GET /v1/models), over the pool (a client here would close it on exit)."""
        request = httpx.Request(
            "GET",
            served.engine.base_url.rstrip("/") + "/models",
            headers={"Authorization": f"Bearer {served.engine.api_key}"},
            extensions={"timeout": httpx.Timeout(60).as_dict()},
        )
        response = await self.inner.handle_async_request(request)
        try:
            body = json.loads(await response.aread())
        finally:
            await response.aclose()
        return {m["id"] for m in body.get("data", [])} if response.status_code == 200 else set()

    async def aclose(self) -> None:
        """A client closing leaves the pool to the backend: other clients of the same model share it."""

    async def close_pool(self) -> None:
        self._on_this_loop()
        await self.inner.aclose()


def _connection_pool() -> httpx.AsyncHTTPTransport:
    return httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100))


def _unavailable(served: ServedModel, error: Exception) -> str:
    return (
        f"the inference engine for {served.model.name!r} could not be started or could not serve step "
        f"{served.step} ({type(error).__name__}: {error}); fix the cause and send the request again: the next "
        "request starts it again"
    )
