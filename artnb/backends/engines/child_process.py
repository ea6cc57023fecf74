"""The client side both engines share: a server child process that never outlives the notebook.

Why one module: HFEngine (hf/client.py) and VLLMEngine (vllm/client.py) differ in the command they launch and
in their control calls, not in how a server is started, watched and stopped; that lifecycle lives here once.

`EngineProcess` is the generic part: it starts a command in its own process group with its output in a log
file, waits for `/health` with a progress message, and stops the whole group (terminate, then kill after a
grace period). Three things keep a server from outliving its parent: `stop()` registered with atexit, the
process group (so helper processes die too), and the server itself exiting when its parent does (both servers
watch `os.getppid()`), which covers a kernel killed with SIGKILL, where atexit never runs.

`ServerEngine` is the base class of both engine clients (port, API key, log, alive, stop, control calls);
each subclass builds its server's command line and launches it with `_launch_until_ready()`. An automatic port
(picked below the kernel's ephemeral range, see ports.py) is checked before launch, yet another program can still
take it before the server binds (the server loads its model first): a server that exits on "address already in
use" is launched again on a new port, up to PORT_TRIES times. A port the user chose is never changed.

Control calls (load/unload adapters, stats, release) time out after `control_timeout_s` (60 s: they take
milliseconds to seconds, so a minute means the engine is hung or stopped). `hold()` waits for the batch in
flight to finish, which on CPU can legitimately take minutes (32 rows of long completions), so it has its own
`hold_timeout_s` (15 min). A timeout raises TimeoutError naming the call, the engine, the limit and the log;
a failed or timed-out hold is released (best effort), so the engine is not left holding requests forever.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import httpx
from tqdm.auto import tqdm

import artnb
from artnb.backends.engines.guard import DEFAULT_MAX_REQUEST_BYTES
from artnb.backends.ports import free_port, port_free

log = logging.getLogger("artnb")


class EngineProcess:
    """A server command run as a child process group, with a log file and a health check.

    >>> p = EngineProcess(["python", "-m", "http.server", "8000"], "server.log", "http://127.0.0.1:8000/")
    >>> p.start(); p.wait_ready(timeout=30); p.stop()
    """

    def __init__(
        self,
        command: list[str],
        log_path: str | Path,
        health_url: str,
        *,
        name: str = "engine",
        env: dict[str, str] | None = None,
    ):
        self.command, self.log_path, self.health_url, self.name = command, Path(log_path), health_url, name
        self.env = env
        self._proc: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None
        self.log_start = 0  # where this run's lines begin in the (appended) log

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        """None while running (or never started); the exit status after; negative for a signal."""
        return self._proc.poll() if self._proc else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        if self.alive():
            raise RuntimeError(f"{self.name} is already running (pid {self.pid}): stop() it first")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.log_start = self._log.tell()
        self._proc = subprocess.Popen(
            self.command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            start_new_session=True,  # its own process group, so stop() reaches its children too
        )
        atexit.register(self.stop)

    def lost_its_port(self) -> bool:
        """It exited because its port was taken (uvicorn's and vLLM's bind errors, in this run's lines)."""
        if self.alive() or not self.log_path.exists():
            return False
        with open(self.log_path, "rb") as f:
            f.seek(self.log_start)
            return b"address already in use" in f.read().lower()

    def log_tail(self, lines: int = 20) -> str:
        if not self.log_path.exists():
            return "(no log yet)"
        with open(self.log_path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines))

    def wait_ready(self, timeout: float = 300) -> None:
        """Block until `health_url` answers 200; raise with the log's last lines if it dies or times out."""
        deadline = time.monotonic() + timeout
        with tqdm(desc=f"artnb: starting {self.name}", bar_format="{desc} [{elapsed}] {postfix}") as bar:
            # A widget or a terminal redraws in place; a log file or pipe gets a new line each time: rarely there.
            live = type(bar).__module__ == "tqdm.notebook" or sys.stderr.isatty()
            shown = time.monotonic()
            while True:
                if not self.alive():
                    raise RuntimeError(
                        f"{self.name} exited with code {self.returncode} before it was ready; full log: "
                        f"{self.log_path}. Last lines:\n{self.log_tail()}"
                    )
                try:
                    if httpx.get(self.health_url, timeout=2).status_code == 200:
                        bar.set_postfix_str("ready")
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(
                        f"{self.name} was not ready after {timeout:g}s and was stopped; full log: "
                        f"{self.log_path}. Last lines:\n{self.log_tail()}\nIf the log shows no error, the model "
                        f"may just be slow to load: give it longer, LocalBackend(engine_options={{'start_timeout_s': "
                        f"{max(2 * timeout, 600):.0f}}})."
                    )
                if live or time.monotonic() - shown > 15:
                    bar.set_postfix_str(self.log_tail(1).strip()[-80:])
                    shown = time.monotonic()
                time.sleep(0.25)

    def stop(self, grace_s: float = 5) -> None:
        """Terminate the process group, kill it if still running after `grace_s`; safe to call twice."""
        atexit.unregister(self.stop)
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        _signal_group(proc.pid, signal.SIGKILL)  # helpers the server started, if any outlived it
        deadline = time.monotonic() + 10  # a killed process takes a moment to go (longer on a loaded machine)
        while _group_exists(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._log:
            self._log.close()
            self._log = None


def _group_exists(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


PORT_TRIES = 3  # launches of a server whose automatic port another program took before it could bind


class ServerEngine:
    """What both engines share: a server child process on 127.0.0.1 with an API key, and its HTTP control API.

    Subclasses set `kind` (for messages and the log name) and implement `start()` by building a command and
    calling `_launch_until_ready()`. The limits (`max_request_bytes`, `control_timeout_s`, `hold_timeout_s`)
    are the subclasses' constructor options; see the module docstring for the timeouts.
    """

    kind = "engine"

    def __init__(
        self,
        model_path: str | Path,
        served_name: str,
        log_dir: str | Path,
        port: int | None,
        *,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        control_timeout_s: float = 60.0,
        hold_timeout_s: float = 900.0,
        start_timeout_s: float | None = None,
        unanswered_s: float = 60.0,
        chat_template: str | None = None,
        default_chat_template_kwargs: Mapping[str, Any] | None = None,
    ):
        for name, value in [
            ("unanswered_s", unanswered_s),
            ("max_request_bytes", max_request_bytes),
            ("control_timeout_s", control_timeout_s),
            ("hold_timeout_s", hold_timeout_s),
            ("start_timeout_s", 1 if start_timeout_s is None else start_timeout_s),
        ]:
            if value <= 0:
                raise ValueError(f"{name}={value}: pass a positive number")
        self.model_path = os.path.expanduser(str(model_path))  # a hub id stays as it is
        self.served_name, self.log_dir = served_name, Path(log_dir)
        self._auto_port = port is None
        self.port = free_port() if port is None else port
        self.api_key = secrets.token_urlsafe(24)
        self.max_request_bytes = max_request_bytes
        self.control_timeout_s, self.hold_timeout_s = control_timeout_s, hold_timeout_s
        self.start_timeout_s = start_timeout_s  # None: the engine's own default (start())
        self.unanswered_s = unanswered_s  # a request waiting this long has the engine's /health checked
        self.chat_template = chat_template
        self.default_chat_template_kwargs = dict(default_chat_template_kwargs or {})
        json.dumps(self.default_chat_template_kwargs)  # a TypeError now, not a server that cannot start
        self._process: EngineProcess | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.kind.lower()}_engine_{self.port}.log"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def returncode(self) -> int | None:
        return self._process.returncode if self._process else None

    def alive(self) -> bool:
        return self._process is not None and self._process.alive()

    def _claim_port(self) -> None:
        """Check the port before launching: a fixed port in use is an error, an automatic one is re-picked."""
        if self.alive():
            raise RuntimeError(
                f"this {self.kind} engine is already running (pid {self.pid}): stop() it before starting again"
            )
        if port_free(self.port):
            return
        if not self._auto_port:
            raise OSError(
                f"port {self.port} on 127.0.0.1 is already in use (another engine or server?): pass "
                f"port=None to pick a free port, or stop what listens there (`lsof -i :{self.port}`)"
            )
        self.port = free_port()

    def _chat_template_args(self) -> list[str]:
        """`--chat-template FILE` and `--default-chat-template-kwargs JSON`, vLLM's flags, which the HF server
        takes too. The template goes through a file in the log folder: a long one may not fit in a command-line
        argument (128 KiB on Linux), and the file records what the engine rendered with."""
        args = []
        if self.chat_template is not None:
            path = self.log_dir / f"{self.kind.lower()}_chat_template.jinja"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(self.chat_template, encoding="utf-8")
            args += ["--chat-template", str(path)]
        if self.default_chat_template_kwargs:
            args += ["--default-chat-template-kwargs", json.dumps(self.default_chat_template_kwargs)]
        return args

    def _server_env(self, extra: dict[str, str]) -> dict[str, str]:
        """The child's environment: ours, artnb importable, unbuffered output, then `extra` (which wins)."""
        package_root = str(Path(artnb.__file__).resolve().parent.parent)
        return {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1",
            **extra,
        }

    async def _launch_until_ready(
        self, command: Callable[[], list[str]], env: dict[str, str], timeout: float
    ) -> EngineProcess:
        """Launch `command()` (built for `self.port`) and wait until it answers /health; an automatic port taken
        before the server could bind it is picked again (see the module docstring). Each launch gets `timeout`:
        a relaunch loads the model again."""
        tries = 1
        while True:
            health = f"http://127.0.0.1:{self.port}/health"
            name = f"{self.kind} engine ({self.served_name})"
            self._process = process = EngineProcess(command(), self.log_path, health, name=name, env=env)
            process.start()
            try:
                await asyncio.to_thread(process.wait_ready, timeout)
                return process
            except RuntimeError:
                if not (self._auto_port and tries < PORT_TRIES and process.lost_its_port()):
                    raise
            log.info(
                "artnb: port %d was taken before the %s engine bound it; trying another", self.port, self.kind
            )
            await asyncio.to_thread(process.stop)  # its log file, its exit hook and any helper it started
            self.port, tries = free_port(), tries + 1

    async def stop(self) -> None:
        await asyncio.to_thread(self.stop_now)

    def stop_now(self) -> None:
        """Stop the server from synchronous code (blocks up to the grace period); safe to call twice."""
        if self._process:
            self._process.stop()

    async def __aenter__(self):
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self, timeout: float = 300) -> None:
        raise NotImplementedError

    async def set_default_temperature(self, temperature: float | None) -> None:
        """Requests that name no temperature sample at `temperature` (None: the engine's own default, 1)."""
        await self._call("POST", "/artnb/defaults", {"temperature": temperature})

    async def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        params: dict[str, Any] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> Any:
        """One control request; a non-200 answer raises with the server's message (and its log if it died).

        No answer within `timeout_s` (default: control_timeout_s) raises TimeoutError.
        """
        if not self.alive():
            raise RuntimeError(
                f"the {self.kind} engine is not running (exit code {self.returncode}): start() it; "
                f"log: {self.log_path}"
            )
        timeout_s = self.control_timeout_s if timeout_s is None else timeout_s
        headers = {"Authorization": f"Bearer {self.api_key}"}
        try:
            async with httpx.AsyncClient(timeout=None) as client:  # wait_for bounds the whole call instead
                request = client.request(
                    method, f"http://127.0.0.1:{self.port}{path}", json=body, params=params, headers=headers
                )
                response = await asyncio.wait_for(request, timeout_s)
        except asyncio.TimeoutError as error:
            raise TimeoutError(
                f"{self.kind} engine (pid {self.pid}, port {self.port}) did not answer {method} {path} within "
                f"{timeout_s:g}s: it may be hung, stopped or overloaded. Check its log {self.log_path}; if "
                f"it is just slow, pass a larger control_timeout_s (hold_timeout_s for hold)"
            ) from error
        if response.status_code != 200:
            try:
                error = response.json().get("error")
                message = error.get("message", error) if isinstance(error, dict) else error
            except (ValueError, AttributeError):
                message = response.text
            if not self.alive() and self._process is not None:
                message = f"{message}. The engine exited (code {self.returncode}); last log lines:\n" + (
                    self._process.log_tail()
                )
            raise RuntimeError(f"{self.kind} engine {path} failed ({response.status_code}): {message}")
        try:
            return response.json()
        except ValueError:
            return response.text

    async def answers(self, timeout_s: float = 10.0) -> bool:
        """Whether the server answers /health within `timeout_s`; a stopped or hung process does not (busy
        ones do: both servers answer it off the generation path)."""
        try:
            await self._call("GET", "/health", timeout_s=timeout_s)
        except (TimeoutError, RuntimeError, httpx.HTTPError):
            return False
        return True

    async def _hold(self) -> None:
        """POST /artnb/hold (waits for the batch in flight); on any failure, release best effort and re-raise."""
        try:
            await self._call("POST", "/artnb/hold", timeout_s=self.hold_timeout_s)
        except BaseException:
            with contextlib.suppress(Exception):
                await self._call("POST", "/artnb/release", timeout_s=min(self.control_timeout_s, 10.0))
            raise
