"""RemoteBackend: the Backend contract over HTTP, so a notebook trains on a GPU machine running `artnb serve`.

    backend = art.RemoteBackend("http://gpu-box:7999", api_key=os.environ["ARTNB_API_KEY"])
    await model.register(backend)       # the server starts the engine; rollouts go through the server's port

Design choices, and why:
- The model's `inference_base_url` is the server's proxy for its engine (`/models/{project}/{name}/v1`) and its
  `inference_api_key` the server's key, so `model.openai_client()` and ART's own
  `AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key)` both work through one port.
- `path` is a local mirror of the server's run directories: after register, train, log and get_step the run's
  history.jsonl and new or changed trajectory files are copied here (never checkpoints; files are added and
  updated, never deleted), so `model.history()`, `model.store`, `RewardPlot(model)` and the TrainingPanel read
  a remote run as they read a local one. A file is fetched again when its size or mtime differs (the mirror
  copies the server's mtime). `model.overwrite_state(...)` stays in the mirror: it is the notebook's state.
- Failures say what happened and what to do. A dropped connection or a server that stopped mid-train raises
  ServerUnavailableError saying the step may have committed and how to check (`await model.get_step()`, which
  waits for a step still running on the server). Nothing is retried behind your back: the next call opens a
  new connection, and if the server restarted and forgot the model it is registered again (resuming at the
  server's newest checkpoint) and the call goes on. Inference requests do the same.
- Train options are resolved here (`resolve_train_config`), so a misspelt option fails before anything is sent;
  a batch over the server's request limit fails here too, naming the limit.
- `close()` closes this client only; the server keeps serving (stop it with Ctrl-C where it runs).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote

import httpx
from tqdm.auto import tqdm

from ..core import metric_names as names
from ..core.atomic import write_atomic
from ..core.ignored import warn_user
from ..core.model import Model, NothingToTrainError, TrainableModel
from ..core.store import RunInUseError, RunStore
from ..core.train_request import SFTRequest, TrainOutcome, TrainRequest
from ..core.trajectory import TrajectoryGroup
from ..core.wire import (
    API_KEY_ENV,
    DEFAULT_PORT,
    ERROR_HEADER,
    NOT_REGISTERED,
    WIRE_VERSION,
    config_to_wire,
    dumps,
    file_signature,
    groups_to_wire,
    lora_from_wire,
    model_to_wire,
    outcome_from_wire,
    trajectories_to_wire,
)
from ..dev.settings import template_read_here
from .art_spellings import ArtTrainSpellings
from .engine_transport import EngineDiedError
from .s3 import BUCKET_ENV, Excludable, S3SyncError, SyncReport, check_exclude, one_step
from .train_step import PHASES


class ServerUnavailableError(ConnectionError):
    """The artnb server could not be reached, or the connection dropped during a call (the message says what
    may have happened on the server and how to check)."""


class RemoteError(RuntimeError):
    """The server failed a call with an error this client has no type for, or answered with an HTTP error."""


# Errors the server reports by type name, raised here as the same type (so `except NothingToTrainError` works).
_KNOWN_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        ValueError, TypeError, KeyError, IndexError, FileNotFoundError, FileExistsError, NotImplementedError,
        PermissionError, RuntimeError, NothingToTrainError, RunInUseError, EngineDiedError, S3SyncError,
    )
}  # fmt: skip
_WARNINGS = {cls.__name__: cls for cls in (UserWarning, RuntimeWarning, DeprecationWarning, FutureWarning)}


class RemoteBackend(ArtTrainSpellings):
    """Train and serve on an `artnb serve` server; read the runs from a local mirror.

    Example:
        backend = art.RemoteBackend("http://127.0.0.1:7999", api_key="...")   # e.g. through an SSH tunnel
        await model.register(backend)
        ...                                   # the same loop as with LocalBackend
        await backend.close()                 # closes this client; the server keeps running

    base_url: the server, e.g. "http://gpu-box:7999".
    api_key: the server's key (`artnb serve --api-key` / $ARTNB_API_KEY there); None reads $ARTNB_API_KEY here.
    path: the local mirror of the server's run directories (history and trajectories, not checkpoints);
      default ./.art-remote/<host>_<port>.
    timeout: seconds without a byte from the server before a call fails as a dropped connection. Long
      operations (engine start, a train step) send a heartbeat every 10 s, so this only bounds silence.
    connect_timeout: seconds to open a connection.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        path: str | Path | None = None,
        timeout: float = 90.0,
        connect_timeout: float = 10.0,
    ) -> None:
        url = httpx.URL(base_url.rstrip("/"))
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"base_url={base_url!r}: pass the server's address, e.g. 'http://gpu-box:7999'")
        self.base_url = str(url)
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or None
        if path is None:
            port = url.port or {"http": 80, "https": 443}[url.scheme]
            path = Path(".art-remote") / f"{re.sub(r'[^A-Za-z0-9.-]', '_', url.host)}_{port}"
        self.path = Path(path).expanduser().resolve()
        self.timeout = httpx.Timeout(timeout, connect=connect_timeout)
        self._models: dict[tuple[str, str], Model] = {}
        self._locks: dict[tuple[str, tuple[str, str]], asyncio.Lock] = defaultdict(asyncio.Lock)
        self._registrations: dict[tuple[str, str], int] = defaultdict(int)  # times each model was registered
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._max_request_bytes: int | None = None

    def __repr__(self) -> str:
        return f"RemoteBackend({self.base_url!r}, path={str(self.path)!r})"  # never the key

    async def __aenter__(self) -> RemoteBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close this client's connections. The server and its engines keep running."""
        if self._client is not None and self._client_loop is asyncio.get_running_loop():
            await self._client.aclose()
        self._client = self._client_loop = None
        for model in self._models.values():
            await asyncio.to_thread(model.reporting.close)  # e.g. finish the W&B run

    # registration ----------------------------------------------------------------------------------------
    async def register(self, model: Model) -> None:
        """Register `model` on the server (a TrainableModel starts serving there, resuming its run) and point
        its inference at the server's proxy for it; then mirror the run's history and trajectories."""
        await self._check_server()
        await self._register_on_server(model)
        self._models[(model.project, model.storage_name)] = model
        if model.trainable:
            model.inference_base_url = f"{self.base_url}{_route(model)}/v1"
            model.inference_api_key = self.api_key or "none"
            model.inference_model_name = model.name
        await self._sync(model)

    async def _check_server(self) -> None:
        """Reach the server, check the key and that it speaks this client's wire format; learn its limits."""
        response = await self._send("GET", "/info", what="connect")
        if response.status_code != 200:
            raise self._http_error(response, "connect")
        info = response.json()
        if info.get("wire") != WIRE_VERSION:
            raise RemoteError(
                f"the server at {self.base_url} runs artnb {info.get('artnb')} (wire format {info.get('wire')}); "
                f"this client speaks wire format {WIRE_VERSION}: install the same artnb version on both"
            )
        self._max_request_bytes = int(info["max_request_bytes"])

    async def _register_on_server(self, model: Model) -> None:
        wire = model_to_wire(model)
        wire["internal_config"] = template_read_here(wire["internal_config"])
        reply = await self._operation(None, "POST", f"{_route(model)}/register", dumps(wire))
        self._registrations[model.project, model.storage_name] += 1
        if isinstance(model, TrainableModel) and reply.get("lora") is not None:
            lora = lora_from_wire(reply["lora"])  # the server applied the model's _internal_config to it
            if lora != model.lora:
                model.lora = lora
            if trainer := reply.get("trainer"):  # as LocalBackend prints them here
                placement = reply.get("placement")
                print(
                    f"artnb: {self.base_url} trains {model.name} with its {trainer}"
                    + (f"; {placement}" if placement else ""),
                    flush=True,
                )

    def registrations(self, model: Model) -> int:
        """How many times this client registered the model on the server (see `register_again`)."""
        return self._registrations[model.project, model.storage_name]

    async def register_again(self, model: Model, seen: int) -> None:
        """The server forgot the model (it restarted): register it again; it resumes at its newest checkpoint.
        `seen`: the registration count when the failed request was sent (requests that failed together, e.g. a
        gather's rollouts, register once)."""
        key = (model.project, model.storage_name)
        async with self._locks["register", key]:
            if self._registrations[key] != seen:
                return  # another request registered it meanwhile
            warn_user(
                f"artnb: the server at {self.base_url} did not know {model.project}/{model.storage_name} (it restarted?); "
                "registering it again: it resumes at its newest committed step"
            )
            await self._check_server()
            await self._register_on_server(model)
            if isinstance(model, TrainableModel) and model.default_temperature is not None:
                # the server forgot the model's default temperature too
                await self.set_default_temperature(model, model.default_temperature)

    def _registered(self, model: Model) -> Model:
        if self._models.get((model.project, model.storage_name)) is None:
            raise RuntimeError(
                f"model {model.project}/{model.storage_name} is not registered on this backend: call "
                "`await model.register(backend)` first"
            )
        return model

    # training --------------------------------------------------------------------------------------------
    async def get_step(self, model: TrainableModel) -> int:
        """The newest committed step on the server (after any step still running there for this model)."""
        self._registered(model)
        reply = await self._operation(model, "GET", f"{_route(model)}/step")
        await self._sync(model)
        return int(reply["step"])

    async def train_step(self, model: TrainableModel, request: TrainRequest) -> TrainOutcome:
        """One GRPO step on the server, as `LocalBackend.train_step` (same commit and failure rules).

        A tqdm bar follows the step's phases. If the connection drops mid-step, ServerUnavailableError says
        so; the step may have committed on the server: `await model.get_step()` tells.
        """
        self._registered(model)
        config = request.config
        body = await asyncio.to_thread(
            lambda: dumps({"batch": groups_to_wire(request.batch()), "config": config_to_wire(config)})
        )
        outcome = outcome_from_wire(await self._train_call(model, "train", body))
        await self._sync(model)
        if config.verbose:
            print("artnb train: " + ", ".join(f"{k}={v:.4g}" for k, v in _numbers(outcome.result.metrics)))
        return outcome

    async def train_sft_step(self, model: TrainableModel, request: SFTRequest) -> TrainOutcome:
        """One SFT step on the server, as `LocalBackend.train_sft_step` (committed like a GRPO step)."""
        self._registered(model)
        body = await asyncio.to_thread(
            lambda: dumps(
                {
                    "trajectories": trajectories_to_wire(request.trajectories),
                    "config": config_to_wire(request.config),
                }
            )
        )
        outcome = outcome_from_wire(await self._train_call(model, "train_sft", body))
        await self._sync(model)
        return outcome

    async def _train_call(self, model: TrainableModel, route: str, body: bytes) -> dict[str, Any]:
        """POST a train step with a bar over its phases; a lost connection names what may have happened."""
        self._check_size(body, route)
        with tqdm(total=len(PHASES), desc=f"{route} {model.name}", unit="phase") as bar:
            bar.set_postfix_str("sending")

            def on_phase(phase: str) -> None:
                bar.update(PHASES.index(phase) + 1 - bar.n)
                bar.set_postfix_str(phase)

            reply = await self._operation(
                model, "POST", f"{_route(model)}/{route}", body, on_phase, lost=route
            )
            bar.update(bar.total - bar.n)
            bar.set_postfix_str("done")
        return reply

    async def _experimental_fork_checkpoint(
        self,
        model: TrainableModel,
        from_model: str,
        from_project: str | None = None,
        from_s3_bucket: str | None = None,
        not_after_step: int | None = None,
        verbose: bool = False,
        prefix: str | None = None,
    ) -> int:
        """`LocalBackend._experimental_fork_checkpoint` on the server: both runs must be in the server's path."""
        self._registered(model)
        options = {
            "from_model": from_model,
            "from_project": from_project,
            "from_s3_bucket": from_s3_bucket,
            "not_after_step": not_after_step,
            "prefix": prefix,
        }
        reply = await self._operation(model, "POST", f"{_route(model)}/fork", dumps(options))
        forked = int(reply["step"])
        await self._sync(model)
        if verbose:
            print(
                f"forked {from_project or model.project}/{from_model} step {forked} into {model.project}/{model.storage_name}"
            )
        return forked

    async def _experimental_push_to_s3(
        self,
        model: Model,
        s3_bucket: str | None = None,
        prefix: str | None = None,
        verbose: bool = False,
        delete: bool = False,
    ) -> SyncReport:
        """`LocalBackend._experimental_push_to_s3` on the server: its run directory, its AWS credentials. The
        bucket defaults to $BACKUP_BUCKET here, else the server's."""
        options = {"s3_bucket": s3_bucket or os.environ.get(BUCKET_ENV), "prefix": prefix, "delete": delete}
        reply = await self._operation(None, "POST", f"{_route(model)}/push_to_s3", dumps(options))
        report = SyncReport(**reply["report"])
        if verbose:
            print(
                f"pushed {model.project}/{model.storage_name} on the server: {len(report.uploaded)} files; steps {report.steps}"
            )
        return report

    async def _experimental_pull_from_s3(
        self,
        model: Model,
        step: int | Literal["latest"] | None = None,
        s3_bucket: str | None = None,
        prefix: str | None = None,
        verbose: bool = False,
        delete: bool = False,
        *,
        only_step: int | Literal["latest"] | None = None,
        latest_only: bool = False,
        exclude: list[Excludable] | None = None,
    ) -> SyncReport:
        """`LocalBackend._experimental_pull_from_s3` on the server (before `model.register(backend)`), then the
        pulled history and trajectories are mirrored here."""
        options = {
            "step": one_step(step, only_step, latest_only),
            "s3_bucket": s3_bucket or os.environ.get(BUCKET_ENV),
            "prefix": prefix,
            "delete": delete,
            "exclude": sorted(check_exclude(exclude)) or None,
        }
        reply = await self._operation(None, "POST", f"{_route(model)}/pull_from_s3", dumps(options))
        report = SyncReport(**reply["report"])
        await self._sync(model)
        if verbose:
            print(f"pulled {model.project}/{model.storage_name} on the server: steps {report.steps}")
        return report

    async def log(
        self, model: Model, split: str, step: int, row: dict[str, Any], groups: Sequence[TrajectoryGroup]
    ) -> None:
        """Record a history row and the groups' trajectories in the server's run (`model.log`), then mirror it."""
        self._registered(model)
        body = await asyncio.to_thread(
            lambda: dumps({"split": split, "step": step, "row": row, "batch": groups_to_wire(groups)})
        )
        self._check_size(body, "log")
        await self._operation(model, "POST", f"{_route(model)}/log", body)
        await self._sync(model)

    async def delete_checkpoints(
        self, model: TrainableModel, best_checkpoint_metric: str = names.BEST_CHECKPOINT_METRIC
    ) -> list[int]:
        """Keep the latest checkpoint and the best by `best_checkpoint_metric` on the server; the deleted steps."""
        self._registered(model)
        body = dumps({"best_checkpoint_metric": best_checkpoint_metric})
        reply = await self._operation(model, "POST", f"{_route(model)}/delete_checkpoints", body)
        return [int(s) for s in reply["deleted"]]

    async def set_default_temperature(self, model: TrainableModel, temperature: float) -> None:
        """The temperature the model's engine on the server samples at when a request names none."""
        self._registered(model)
        body = dumps({"temperature": temperature})
        await self._operation(model, "POST", f"{_route(model)}/default_temperature", body)

    def http_client(self, model: TrainableModel) -> httpx.AsyncClient:
        """The HTTP client behind `model.openai_client()`: to the server's proxy for the model's engine; a
        server that forgot the model (restarted) gets it registered again before the request is retried."""
        return httpx.AsyncClient(
            transport=_ServerTransport(self, model), timeout=httpx.Timeout(1200, connect=10)
        )

    # the mirror ------------------------------------------------------------------------------------------
    async def _sync(self, model: Model) -> None:
        """Copy the run's history.jsonl and new or changed trajectory files from the server into `self.path`.
        A failure is a warning: what the call did on the server stands, and the next call syncs again."""
        try:
            await self._copy_run_files(model)
        except (OSError, RemoteError) as error:
            warn_user(
                f"artnb: the local mirror of {model.project}/{model.storage_name} in {self.path} could not be updated "
                f"({_cause(error)}); model.history() and the plots may lag until the next call updates it"
            )

    async def _copy_run_files(self, model: Model) -> None:
        route = _route(model)
        store = RunStore(self.path, model.project, model.storage_name)
        async with self._locks["sync", (model.project, model.storage_name)]:
            listing = await self._get_json(f"{route}/files", "mirror")
            for entry in listing["files"]:
                if entry["kind"] == "history":
                    local, source = store.history_path, f"{route}/history"
                else:
                    split, step = entry["split"], int(entry["step"])
                    local = store.trajectories_path(split, step)
                    source = f"{route}/trajectories/{quote(split, safe='')}/{step}"
                if file_signature(local) == {"size": entry["size"], "mtime_ns": entry["mtime_ns"]}:
                    continue
                response = await self._send("GET", source, what="mirror")
                if response.status_code == 404:
                    continue  # gone since the listing
                if response.status_code != 200:
                    raise self._http_error(response, "mirror")
                mtime_ns = int(response.headers["x-artnb-mtime-ns"])
                await asyncio.to_thread(_write_mirrored, local, response.content, mtime_ns)

    # HTTP ------------------------------------------------------------------------------------------------
    def _http(self) -> httpx.AsyncClient:
        """One client per event loop (a client's connections belong to the loop that opened them)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._client = httpx.AsyncClient(base_url=self.base_url, headers=headers, timeout=self.timeout)
            self._client_loop = loop
        return self._client

    async def _send(
        self, method: str, route: str, *, what: str, content: bytes | None = None
    ) -> httpx.Response:
        try:
            return await self._http().request(method, route, content=content)
        except httpx.ConnectError as error:
            raise self._unreachable(error) from error
        except httpx.TransportError as error:
            raise self._no_answer(error, what) from error

    async def _get_json(self, route: str, what: str) -> dict[str, Any]:
        response = await self._send("GET", route, what=what)
        if response.status_code != 200:
            raise self._http_error(response, what)
        return response.json()

    async def _operation(
        self,
        model: Model | None,
        method: str,
        route: str,
        content: bytes | None = None,
        on_phase: Callable[[str], None] | None = None,
        *,
        lost: str | None = None,
    ) -> dict[str, Any]:
        """One NDJSON operation: phases to `on_phase`, warnings re-raised here, then its result or its error.

        `model`: registered again (once) if the server answers that it does not know it. `lost`: the name of a
        train call, whose lost connection may have left a committed step behind.
        """
        what = route.rsplit("/", 1)[-1]
        phase: str | None = None
        answered = False  # the server starts an operation only after it has answered with its headers
        for attempt in (1, 2):
            # the model and its registration count as this request is sent (see register_again)
            registered = (
                None if model is None else (model, self._registrations[model.project, model.storage_name])
            )
            try:
                async with self._http().stream(method, route, content=content) as response:
                    answered = True
                    if response.status_code != 200:
                        await response.aread()
                        if attempt == 1 and registered is not None and _not_registered(response):
                            await self.register_again(*registered)
                            continue
                        raise self._http_error(response, what, len(content or b""))
                    async for line in response.aiter_lines():
                        if not line:
                            continue
                        event = json.loads(line)
                        kind = event.get("event")
                        if kind == "result":
                            return event
                        if kind == "error":
                            raise _remote_exception(event)
                        if kind == "warning":
                            warn_user(event["message"], _WARNINGS.get(event.get("category"), UserWarning))
                        elif kind == "phase":
                            phase = str(event["phase"])
                            if on_phase is not None:
                                on_phase(phase)
                    raise httpx.RemoteProtocolError("the server closed the stream before the result")
            except httpx.ConnectError as error:
                raise self._unreachable(error) from error
            except httpx.TransportError as error:
                if not answered:
                    raise self._no_answer(error, what) from error
                raise self._lost(error, what, model, lost, phase) from error
        raise AssertionError("unreachable")  # the second attempt returns or raises

    def _unreachable(self, error: Exception) -> ServerUnavailableError:
        return ServerUnavailableError(
            f"cannot reach the artnb server at {self.base_url} ({_cause(error)}): is `artnb serve` "
            "running there, and the SSH tunnel (if you use one) open? Nothing was sent."
        )

    def _no_answer(self, error: Exception, what: str) -> ServerUnavailableError:
        return ServerUnavailableError(
            f"no answer from the artnb server at {self.base_url} to {what} ({_cause(error)}), so nothing was done "
            "there: is `artnb serve` running (an SSH tunnel accepts connections even when nothing is behind it)? "
            "The next call reconnects."
        )

    def _lost(
        self, error: Exception, what: str, model: Model | None, train: str | None, phase: str | None
    ) -> ServerUnavailableError:
        problem = f"the connection to the artnb server at {self.base_url} was lost during {what}"
        cause = _cause(error)
        if train is None or model is None:
            return ServerUnavailableError(f"{problem} ({cause}); the next call reconnects")
        return ServerUnavailableError(
            f"{problem}() of {model.project}/{model.storage_name} ({cause}; last phase seen: {phase or 'none yet'}). The "
            "step may have committed on the server (a step whose trainer started commits even when its caller "
            "goes away): `await model.get_step()` tells you, and waits for a step still running there. If the "
            "step advanced, this batch is trained and recorded: do not train it again. The next call reconnects, "
            "and registers the model again if the server restarted."
        )

    def _http_error(self, response: httpx.Response, what: str, size: int = 0) -> Exception:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:500]
        status = response.status_code
        if status == 401:
            return PermissionError(
                f"the artnb server at {self.base_url} refused the API key ({message}). Pass "
                f"RemoteBackend(base_url, api_key=...) or set ${API_KEY_ENV} to the key the server was started with"
            )
        if status == 413:
            return ValueError(
                f"{what}: the request ({size} bytes) is over the server's request limit ({message}). Restart "
                "`artnb serve` with a larger --max-request-bytes, or send fewer groups per call"
            )
        if status == 404 and _not_registered(response):
            return RuntimeError(message)
        return RemoteError(f"{what}: the artnb server at {self.base_url} answered {status}: {message}")

    def _check_size(self, body: bytes, what: str) -> None:
        limit = self._max_request_bytes
        if limit is not None and len(body) > limit:
            raise ValueError(
                f"{what}: this request is {len(body) / 2**20:.1f} MiB as JSON, over the server's limit of "
                f"{limit / 2**20:.1f} MiB; nothing was sent. Restart `artnb serve` with a larger "
                "--max-request-bytes, or send fewer groups per call"
            )


class Backend(RemoteBackend):
    """ART 0.3-0.4's client of a backend server: `art.Backend(base_url="http://gpu-box:7999")` is a
    RemoteBackend (the key from `api_key=` or $ARTNB_API_KEY). `close()` closes the client, not the server."""

    def __init__(
        self,
        *,
        base_url: str = f"http://127.0.0.1:{DEFAULT_PORT}",
        path: str | Path | None = None,
        api_key: str | None = None,
        **options: Any,
    ) -> None:
        super().__init__(base_url, api_key, path=path, **options)


class _ServerTransport(httpx.AsyncBaseTransport):
    """Inference requests to the server's proxy for one model; registers the model again if the server forgot
    it (a restart) and retries the request once."""

    def __init__(self, backend: RemoteBackend, model: TrainableModel) -> None:
        self.backend, self.model = backend, model
        self.inner = httpx.AsyncHTTPTransport(
            limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.backend.api_key:
            request.headers["Authorization"] = f"Bearer {self.backend.api_key}"
        registered = self.backend.registrations(self.model)
        response = await self.inner.handle_async_request(request)
        if response.status_code == 404 and response.headers.get(ERROR_HEADER) == NOT_REGISTERED:
            await response.aclose()
            await self.backend.register_again(self.model, registered)
            response = await self.inner.handle_async_request(request)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


def _route(model: Model) -> str:
    return f"/models/{quote(model.project, safe='')}/{quote(model.storage_name, safe='')}"


def _not_registered(response: httpx.Response) -> bool:
    return response.status_code == 404 and response.headers.get(ERROR_HEADER) == NOT_REGISTERED


def _cause(error: Exception) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _remote_exception(event: dict[str, Any]) -> Exception:
    kind, message = event.get("type", "Error"), event.get("message", "")
    cls = _KNOWN_ERRORS.get(kind)
    return cls(message) if cls is not None else RemoteError(f"{kind} on the artnb server: {message}")


def _numbers(metrics: dict[str, Any]) -> list[tuple[str, float]]:
    return [
        (k, float(v)) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
    ]


def _write_mirrored(path: Path, content: bytes, mtime_ns: int) -> None:
    write_atomic(path, content)
    os.utime(path, ns=(mtime_ns, mtime_ns))  # the server's mtime: how the next sync tells it is unchanged
