"""`artnb serve`: one LocalBackend behind HTTP, so a notebook on another machine trains here (`RemoteBackend`).

Design choices, and why:
- One port for everything: the control routes below and each model's OpenAI-compatible endpoint, proxied at
  `/models/{project}/{name}/v1/...` to that model's engine through `LocalBackend.http_client` (which restarts a
  dead engine and follows its new port). One open port, or one SSH tunnel, is enough; streamed responses pass
  through chunk by chunk, and a client that goes away cancels its upstream request.
- The API key guards every route but `/health` (guard.RequestGuard: checked from the headers before a body is
  read, in constant time; bodies over `max_request_bytes` get 413 unread). The server refuses to listen beyond
  loopback without a key. No docs routes.
- Operations that can take long (register starts an engine, train, ...) answer NDJSON: zero or more events
  (`phase` of the train step, `warning`, a `heartbeat` every HEARTBEAT_S so a dead connection is noticed by
  the client's read timeout and idle tunnels stay open), then one `result` or one `error` line with the
  exception's type and message.
- A client that disconnects mid-operation cancels it, with LocalBackend's meaning: a train step cancelled before
  its trainer starts does nothing, after that it commits first. `GET .../step` waits for the model's operations
  still running, so after a dropped connection it says whether the step committed.
- A model is served only after `register`; after a restart every route of an unregistered model answers 404
  with the header `x-artnb-error: model-not-registered`, and the client registers it again (it resumes from
  the newest checkpoint) and retries. Reading a run's files needs no registration.
- The run's history and trajectory files can be listed and downloaded (never checkpoints): the client keeps a
  local mirror of them, which is what `model.history()` and the widgets read.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import os
import re
import warnings
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..core.config import TrainerConfig
from ..core.model import Model, NothingToTrainError, TrainableModel
from ..core.names import check_name
from ..core.store import RunStore
from ..core.train_request import SFTRequest, TrainRequest
from ..core.wire import (
    API_KEY_ENV,
    DEFAULT_PORT,
    ERROR_HEADER,
    NOT_REGISTERED,
    WIRE_VERSION,
    dumps,
    error_to_wire,
    file_signature,
    groups_from_wire,
    loads,
    model_from_wire,
    outcome_to_wire,
    sft_config_from_wire,
    train_config_from_wire,
    trajectories_from_wire,
)
from .engines.guard import ClientGone, RequestGuard, error_body, while_connected
from .local import LocalBackend

log = logging.getLogger("artnb.serve")

# A train request carries every rollout with its sampling logprobs and token ids: ~100 bytes per sampled token
# as JSON, so 256 MiB holds ~2.5M sampled tokens (e.g. 64 groups x 16 rollouts x 2,500 tokens).
DEFAULT_MAX_REQUEST_BYTES = 256 * 2**20
HEARTBEAT_S = 10.0  # a line at least this often during an operation; the client's read timeout is longer
# The server loads adapters itself (the newest committed step); a client must not swap them under it.
_ENGINE_ONLY = {"load_lora_adapter", "unload_lora_adapter"}
_HOP_BY_HOP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "authorization", "content-length",
}  # fmt: skip

# Set inside each operation's task: where its warnings and phase events go (its loop and its queue).
_operation_events: ContextVar[tuple[asyncio.AbstractEventLoop, asyncio.Queue] | None] = ContextVar(
    "artnb_operation_events", default=None
)


def is_loopback(host: str) -> bool:
    """True for hosts only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None) -> None:
    """Refuse to listen beyond loopback without an API key: anyone reaching the port could train and serve."""
    if not api_key and not is_loopback(host):
        raise ValueError(
            f"refusing to serve on {host!r} without an API key: anyone who can reach this port could run and "
            f"train models on this machine. Pass --api-key KEY (or set ${API_KEY_ENV}), or serve on 127.0.0.1 "
            "and reach it through an SSH tunnel (ssh -N -L 7999:127.0.0.1:7999 you@server)"
        )


class _Refused(Exception):
    """A request the server answers with an error before doing anything (404 unregistered, 400 bad name)."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class _PhaseEvents(logging.Handler):
    """Turns the train step's phase records (DEBUG on "artnb", `record.artnb_phase`) into events for the
    callers training that model. A record names its model in its message: "{project}/{name} step N: phase",
    or the checkpoint path for "rename"."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.listeners: dict[tuple[str, str], list[tuple[re.Pattern, str, Any]]] = defaultdict(list)

    @contextlib.contextmanager
    def listen(self, store: RunStore, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        key = (store.project, store.name)
        entry = (
            re.compile(rf"{re.escape(store.project)}/{re.escape(store.name)} step \d+: "),
            str(store.checkpoints) + os.sep,
            (loop, queue),
        )
        self.listeners[key].append(entry)
        try:
            yield
        finally:
            self.listeners[key].remove(entry)
            if not self.listeners[key]:
                del self.listeners[key]

    def emit(self, record: logging.LogRecord) -> None:
        phase = getattr(record, "artnb_phase", None)
        if phase is None or not self.listeners:
            return
        message = record.getMessage()
        for entries in list(self.listeners.values()):
            for pattern, checkpoints, (loop, queue) in entries:
                if pattern.match(message) or checkpoints in message:
                    loop.call_soon_threadsafe(queue.put_nowait, {"event": "phase", "phase": phase})


def _forward_warnings(original: Callable[..., None]) -> Callable[..., None]:
    """A `warnings.showwarning` that also sends the warning to the caller of the operation that raised it."""

    def show(message, category, filename, lineno, file=None, line=None):
        target = _operation_events.get()
        if target is not None:
            loop, queue = target
            event = {"event": "warning", "category": category.__name__, "message": str(message)}
            loop.call_soon_threadsafe(queue.put_nowait, event)
        original(message, category, filename, lineno, file, line)

    return show


class ArtnbServer:
    """The state behind the routes: the backend, the registered models and their operations in flight."""

    def __init__(self, backend: LocalBackend, *, api_key: str | None, max_request_bytes: int) -> None:
        self.backend = backend
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.models: dict[tuple[str, str], TrainableModel] = {}
        self.inference: dict[tuple[str, str], httpx.AsyncClient] = {}
        self.inflight: dict[tuple[str, str], set[asyncio.Task]] = defaultdict(set)
        self.register_locks: dict[tuple[str, str], asyncio.Lock] = defaultdict(asyncio.Lock)
        self.tasks: set[asyncio.Task] = set()  # cancelled operations still finishing (a step committing)
        self.phases = _PhaseEvents()

    # helpers ----------------------------------------------------------------------------------------------
    def _key(self, project: str, name: str) -> tuple[str, str]:
        try:
            return check_name(project, "project"), check_name(name, "name")
        except ValueError as error:
            raise _Refused(400, str(error)) from None

    def _trainable(self, project: str, name: str) -> TrainableModel:
        key = self._key(project, name)
        model = self.models.get(key)
        if model is None:
            raise _Refused(
                404,
                f"model {project}/{name} is not registered on this server (it may have restarted): call "
                "`await model.register(backend)`; RemoteBackend does this by itself",
                NOT_REGISTERED,
            )
        return model

    def _operation(
        self, work: Callable[[], Awaitable[dict[str, Any]]], key: tuple[str, str] | None = None
    ) -> StreamingResponse:
        """Run `work` as a task and stream its events, heartbeats and outcome as NDJSON lines."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        async def run() -> dict[str, Any]:
            _operation_events.set((loop, events))  # this task's warnings go to this caller
            return await work()

        async def lines() -> AsyncIterator[bytes]:
            task = asyncio.ensure_future(run())
            if key is not None:
                self.inflight[key].add(task)
                task.add_done_callback(self.inflight[key].discard)
            task.add_done_callback(lambda _: events.put_nowait(None))
            getter: asyncio.Future | None = None
            try:
                while True:
                    getter = getter or asyncio.ensure_future(events.get())
                    done, _ = await asyncio.wait({getter}, timeout=HEARTBEAT_S)
                    if not done:
                        yield b'{"event":"heartbeat"}\n'
                        continue
                    event, getter = getter.result(), None
                    if event is None:
                        break
                    yield dumps(event) + b"\n"
                yield dumps(_outcome(task)) + b"\n"
            finally:
                if getter is not None:
                    getter.cancel()
                if not task.done():  # the client went away: cancel, with LocalBackend's meaning
                    task.cancel()
                    self.tasks.add(task)
                    task.add_done_callback(_finished_after_cancel)
                    task.add_done_callback(self.tasks.discard)

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    def _inference_client(self, key: tuple[str, str]) -> httpx.AsyncClient:
        client = self.inference.get(key)
        if client is None:
            client = self.inference[key] = self.backend.http_client(self.models[key])
        return client

    # operations -------------------------------------------------------------------------------------------
    async def register(self, project: str, name: str, body: bytes) -> dict[str, Any]:
        key = self._key(project, name)
        model = model_from_wire(await asyncio.to_thread(loads, body))
        if (model.project, model.storage_name) != key:
            raise ValueError(
                f"the body registers {model.project}/{model.storage_name}, the path {project}/{name}"
            )
        async with self.register_locks[key]:
            await model.register(self.backend)  # as in a notebook: the model's base_path is the server's path
            if not isinstance(model, TrainableModel):  # model_from_wire: a TrainableModel when trainable
                return {"step": None, "lora": None}
            self.models[key] = model
            step = await self.backend.get_step(model)
            trainer = type(self.backend.trainer_of(model)).__name__
            placement = self.backend.placement_of(model)
        return {
            "step": step,
            "lora": model.lora.model_dump(mode="json"),
            "trainer": trainer,  # what the notebook is told it trains with, and where
            "placement": str(placement) if placement is not None else None,
        }

    async def get_step(self, model: TrainableModel) -> dict[str, Any]:
        key = (model.project, model.storage_name)
        running = [t for t in self.inflight.get(key, ()) if t is not asyncio.current_task()]
        if running:  # e.g. a step whose caller's connection dropped: say whether it committed
            await asyncio.wait(running)
        return {"step": await self.backend.get_step(model)}

    async def train(self, model: TrainableModel, body: bytes, sft: bool) -> dict[str, Any]:
        data = await asyncio.to_thread(loads, body)
        store = RunStore(self.backend.path, model.project, model.storage_name)
        events = _operation_events.get()
        assert events is not None, "train runs as an operation (_operation sets its events)"
        with self.phases.listen(store, *events):
            if sft:
                trajectories = await asyncio.to_thread(trajectories_from_wire, data["trajectories"])
                request = SFTRequest(trajectories, sft_config_from_wire(data["config"]))
                outcome = await self.backend.train_sft_step(model, request)
            else:
                groups = await asyncio.to_thread(groups_from_wire, data["batch"])
                failures = getattr(groups, "after_each_failures", None)
                config = train_config_from_wire(data["config"])
                outcome = await self.backend.train_step(model, TrainRequest(list(groups), config, failures))
        return outcome_to_wire(outcome)

    async def log(self, project: str, name: str, body: bytes) -> dict[str, Any]:
        key = self._key(project, name)
        data = await asyncio.to_thread(loads, body)
        groups = await asyncio.to_thread(groups_from_wire, data["batch"])
        model = self.models.get(key) or Model(name=name, project=project)
        await self.backend.log(model, data["split"], int(data["step"]), data["row"], groups)
        return {}

    def files(self, project: str, name: str) -> dict[str, Any]:
        store = RunStore(self.backend.path, *self._key(project, name))
        files = []
        if (signature := file_signature(store.history_path)) is not None:
            files.append({"kind": "history", **signature})
        for split, step in store.trajectory_files():
            if (signature := file_signature(store.trajectories_path(split, step))) is not None:
                files.append({"kind": "trajectories", "split": split, "step": step, **signature})
        return {"files": files}

    def read_file(self, path: Path) -> Response:
        try:
            with open(path, "rb") as f:
                stat = os.fstat(f.fileno())
                content = f.read()
        except FileNotFoundError:
            raise _Refused(404, f"no file {path.name} in this run") from None
        return Response(
            content,
            media_type="application/octet-stream",
            headers={"x-artnb-mtime-ns": str(stat.st_mtime_ns), "x-artnb-size": str(stat.st_size)},
        )

    async def proxy(self, request: Request, project: str, name: str, path: str) -> Response:
        key = self._key(project, name)
        model = self._trainable(project, name)
        if {".", ".."} & set(path.split("/")):
            raise _Refused(400, f"/{path}: no '.' or '..' segments; name the engine's route itself")
        if path.strip("/") in _ENGINE_ONLY:
            raise _Refused(
                403, f"/{path} is not proxied: the server loads each committed step's adapter itself"
            )
        client = self._inference_client(key)
        url = f"{model.inference_base_url}/{path}"
        if request.url.query:
            url += f"?{request.url.query}"
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP]
        upstream = client.build_request(request.method, url, headers=headers, content=await request.body())
        try:
            response = await while_connected(request, client.send(upstream, stream=True))
        except ClientGone:
            return Response(status_code=499)
        except httpx.HTTPError as error:
            return JSONResponse(
                error_body(502, f"the model's inference engine failed: {error}"), status_code=502
            )

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()

        passed = {
            k: v for k, v in response.headers.items() if k.lower() not in _HOP_BY_HOP - {"content-length"}
        }
        return StreamingResponse(chunks(), status_code=response.status_code, headers=passed)

    async def close(self) -> None:
        for client in self.inference.values():
            await client.aclose()
        self.inference.clear()
        await self.backend.close()

    # the app ----------------------------------------------------------------------------------------------
    def app(self) -> RequestGuard:
        """The ASGI app: the routes behind the API key and the body-size limit."""
        server = self

        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI):
            artnb_log = logging.getLogger("artnb")
            level = artnb_log.level
            artnb_log.setLevel(logging.DEBUG)  # the train step's phases are DEBUG records
            artnb_log.addHandler(server.phases)
            try:
                with warnings.catch_warnings():  # restores the filters and showwarning at shutdown
                    warnings.showwarning = _forward_warnings(warnings.showwarning)
                    warnings.filterwarnings("always", category=UserWarning)  # every caller sees its own
                    yield
            finally:
                artnb_log.removeHandler(server.phases)
                artnb_log.setLevel(level)
                await server.close()

        app = FastAPI(title="artnb serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(_Refused)
        async def refused(request: Request, error: _Refused) -> JSONResponse:
            headers = {ERROR_HEADER: error.code} if error.code else None
            return JSONResponse(error_body(error.status, error.message), error.status, headers=headers)

        @app.exception_handler(ValueError)
        async def invalid(request: Request, error: ValueError) -> JSONResponse:
            return JSONResponse(error_body(400, f"invalid request: {error}"), 400)

        @app.exception_handler(KeyError)
        async def missing(request: Request, error: KeyError) -> JSONResponse:
            return JSONResponse(error_body(400, f"invalid request: the body lacks {error}"), 400)

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/info")
        async def info() -> dict[str, Any]:
            return {
                "artnb": version("artnb"),
                "wire": WIRE_VERSION,
                "path": str(server.backend.path),
                "engine": server.backend.engine,
                "trainer": server.backend.trainer,
                "trainer_config": server.backend.trainer_config.model_dump(
                    mode="json", exclude_defaults=True
                ),
                "gpu_cost_per_hour_usd": bill.usd_per_hour if (bill := server.backend.bill) else None,
                "max_request_bytes": server.max_request_bytes,
                "models": [f"{p}/{n}" for p, n in server.models],
            }

        @app.post("/models/{project}/{name}/register")
        async def register(project: str, name: str, request: Request) -> StreamingResponse:
            body = await request.body()
            return server._operation(lambda: server.register(project, name, body))

        @app.get("/models/{project}/{name}/step")
        async def get_step(project: str, name: str) -> StreamingResponse:
            model = server._trainable(project, name)
            return server._operation(lambda: server.get_step(model))

        @app.post("/models/{project}/{name}/train")
        async def train(project: str, name: str, request: Request) -> StreamingResponse:
            model = server._trainable(project, name)
            body = await request.body()
            return server._operation(lambda: server.train(model, body, sft=False), (project, name))

        @app.post("/models/{project}/{name}/train_sft")
        async def train_sft(project: str, name: str, request: Request) -> StreamingResponse:
            model = server._trainable(project, name)
            body = await request.body()
            return server._operation(lambda: server.train(model, body, sft=True), (project, name))

        @app.post("/models/{project}/{name}/log")
        async def log_(project: str, name: str, request: Request) -> StreamingResponse:
            body = await request.body()
            return server._operation(lambda: server.log(project, name, body))

        @app.post("/models/{project}/{name}/default_temperature")
        async def default_temperature(project: str, name: str, request: Request) -> StreamingResponse:
            model = server._trainable(project, name)
            temperature = float(loads(await request.body())["temperature"])

            async def work() -> dict[str, Any]:
                await server.backend.set_default_temperature(model, temperature)
                return {}

            return server._operation(work, (project, name))

        @app.post("/models/{project}/{name}/delete_checkpoints")
        async def delete_checkpoints(project: str, name: str, request: Request) -> StreamingResponse:
            model = server._trainable(project, name)
            metric = loads(await request.body())["best_checkpoint_metric"]

            async def work() -> dict[str, Any]:
                return {"deleted": await server.backend.delete_checkpoints(model, metric)}

            return server._operation(work, (project, name))

        @app.post("/models/{project}/{name}/fork")
        async def fork(project: str, name: str, request: Request) -> StreamingResponse:
            model = server._trainable(project, name)
            options = loads(await request.body())

            async def work() -> dict[str, Any]:
                return {"step": await server.backend._experimental_fork_checkpoint(model, **options)}

            return server._operation(work, (project, name))

        async def s3_sync(project: str, name: str, direction: str, request: Request) -> StreamingResponse:
            key = server._key(project, name)
            options = loads(await request.body())
            model = server.models.get(key) or Model(name=name, project=project)
            sync = getattr(server.backend, f"_experimental_{direction}_s3")

            async def work() -> dict[str, Any]:
                return {"report": dataclasses.asdict(await sync(model, **options))}

            return server._operation(work, key)

        @app.post("/models/{project}/{name}/push_to_s3")
        async def push_to_s3(project: str, name: str, request: Request) -> StreamingResponse:
            return await s3_sync(project, name, "push_to", request)

        @app.post("/models/{project}/{name}/pull_from_s3")
        async def pull_from_s3(project: str, name: str, request: Request) -> StreamingResponse:
            return await s3_sync(project, name, "pull_from", request)

        @app.get("/models/{project}/{name}/files")
        async def files(project: str, name: str) -> dict[str, Any]:
            return await asyncio.to_thread(server.files, project, name)

        @app.get("/models/{project}/{name}/history")
        async def history(project: str, name: str) -> Response:
            store = RunStore(server.backend.path, *server._key(project, name))
            return await asyncio.to_thread(server.read_file, store.history_path)

        @app.get("/models/{project}/{name}/trajectories/{split}/{step}")
        async def trajectories(project: str, name: str, split: str, step: int) -> Response:
            store = RunStore(server.backend.path, *server._key(project, name))
            if step < 0:
                raise _Refused(400, f"step {step}: steps are >= 0")
            try:
                check_name(split, "split")
            except ValueError as error:
                raise _Refused(400, str(error)) from None
            return await asyncio.to_thread(server.read_file, store.trajectories_path(split, step))

        @app.api_route(
            "/models/{project}/{name}/v1/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"]
        )
        async def inference(project: str, name: str, path: str, request: Request) -> Response:
            return await server.proxy(request, project, name, path)

        return RequestGuard(
            app,
            api_key=self.api_key,
            max_request_bytes=self.max_request_bytes,
            key_source=f"`artnb serve --api-key` or ${API_KEY_ENV} on the server",
        )


def _outcome(task: asyncio.Task) -> dict[str, Any]:
    if task.cancelled():
        return {
            "event": "error",
            "type": "CancelledError",
            "message": "the operation was cancelled on the server",
        }
    error = task.exception()
    if error is None:
        return {"event": "result", **task.result()}
    if not isinstance(error, (ValueError, TypeError, LookupError, NotImplementedError, NothingToTrainError)):
        log.error("artnb serve: an operation failed", exc_info=error)
    return {"event": "error", **error_to_wire(error)}


def _finished_after_cancel(task: asyncio.Task) -> None:
    """Log how an operation whose client went away ended (and retrieve its exception)."""
    if task.cancelled():
        log.info(
            "artnb serve: an operation was cancelled as its client disconnected (a train step whose trainer had "
            "started was committed first)"
        )
    elif (error := task.exception()) is not None:
        log.info(
            "artnb serve: an operation whose client disconnected failed: %s: %s", type(error).__name__, error
        )
    else:
        log.info("artnb serve: an operation whose client disconnected finished: %s", task.result())


def create_app(
    backend: LocalBackend, *, api_key: str | None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
) -> RequestGuard:
    """The server's ASGI app over `backend` (what `artnb serve` runs with uvicorn)."""
    return ArtnbServer(backend, api_key=api_key, max_request_bytes=max_request_bytes).app()


def serve(
    path: str | Path = "./.art",
    *,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    api_key: str | None = None,
    engine: str = "auto",
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    engine_options: dict[str, Any] | None = None,
    trainer: str = "auto",
    trainer_config: TrainerConfig | None = None,
    gpu_cost_per_hour_usd: float | None = None,
) -> None:
    """Serve a LocalBackend over `path` until interrupted (`artnb serve`). `api_key` None: $ARTNB_API_KEY."""
    api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
    check_bind(host, api_key)
    if max_request_bytes <= 0:
        raise ValueError(f"max_request_bytes={max_request_bytes}: pass a positive number of bytes")
    import uvicorn

    backend = LocalBackend(
        path=path,
        engine=engine,  # type: ignore[arg-type]
        trainer=trainer,  # type: ignore[arg-type]
        trainer_config=trainer_config,
        engine_options=engine_options,
        gpu_cost_per_hour_usd=gpu_cost_per_hour_usd,
    )
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.info(
        "artnb serve: runs in %s, engine %s, on http://%s:%d (%s), requests up to %d MiB",
        backend.path,
        engine,
        host,
        port,
        "API key required" if api_key else "no API key: loopback only",
        max_request_bytes // 2**20,
    )
    app = create_app(backend, api_key=api_key, max_request_bytes=max_request_bytes)
    uvicorn.run(app, host=host, port=port, access_log=False, timeout_graceful_shutdown=5)
