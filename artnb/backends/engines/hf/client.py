"""The HF engine's client: `HFEngine` starts hf/server.py in a child process and calls its control API.

Why apart from the server: this side runs in the notebook and imports no torch, transformers or FastAPI; the
child-process lifecycle it shares with VLLMEngine is child_process.py's `ServerEngine`. It also chooses the
server's OpenMP environment (`omp_environment`), since a busy machine and an idle one want different waits.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from artnb.backends.engines.child_process import ServerEngine
from artnb.backends.engines.guard import DEFAULT_MAX_REQUEST_BYTES

API_KEY_ENV = "ARTNB_ENGINE_API_KEY"  # how HFEngine hands the server its key
# The server's --decoding: from fixed slot buffers (hf/slots.py), or from a growing cache.
DECODINGS = ("slots", "dynamic")

OMP_ENV_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # GNU libgomp's, which torch's CPU wheel uses
AUTO_OMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
OMP_POLICIES: dict[str, dict[str, str]] = {
    "auto": AUTO_OMP_ENV,
    "active": {"OMP_WAIT_POLICY": "ACTIVE"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
}


def omp_environment(policy: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The OpenMP variables HFEngine sets for its server under `omp_wait_policy=policy`.

    "auto" sets nothing when `environ` (default: os.environ) already sets one of OMP_ENV_KEYS: the user's
    explicit choice wins. "active" and "passive" always set theirs.
    """
    environ = os.environ if environ is None else environ
    if policy == "auto" and any(key in environ for key in OMP_ENV_KEYS):
        return {}
    return dict(OMP_POLICIES[policy])


class HFEngine(ServerEngine):
    """The transformers inference server (hf/server.py) in a child process, with its control API.

    >>> engine = HFEngine(artnb.models.tiny(), "base", log_dir="logs")
    >>> await engine.start()
    >>> client = openai.AsyncOpenAI(base_url=engine.base_url, api_key=engine.api_key)
    >>> await engine.stop()

    max_request_bytes: larger request bodies get 413 unread (32 MiB; a 2048-token chat is ~10 kB).
    trust_request_chat_template: render a `chat_template` sent with a request; off, such requests get 400.
    chat_template: template text to render every request with instead of the tokenizer's own (trusted: it is
        this engine's configuration, not a request's). default_chat_template_kwargs: the template's variables
        for every request (e.g. {"enable_thinking": False}); a request's own `chat_template_kwargs` override
        them key by key. vLLM's `--chat-template` / `--default-chat-template-kwargs`, with the same meaning.
    control_timeout_s, hold_timeout_s: how long control calls and hold() wait for an answer (child_process.py);
      start_timeout_s: how long a start may take before it is given up (default 300 s); unanswered_s: how long
      a request may wait before the transport checks that the engine still answers (and says so if not).
    merge_newest: serve each family's newest adapter (what plain `agent` resolves to, the one RL samples
        from) with its weights merged into the base linear layers, so it decodes at the base model's speed
        (unmerged LoRA made the engine ~30% slower on a CPU). None (default): on for CPU, off for CUDA, where
        LoRA matmuls are cheap and the merged copy costs GPU memory. Costs: one extra copy of the adapted
        layers' weights (all linear layers of SmolLM2-135M in fp32: ~425 MB) and one merge pass when a new
        adapter loads; switching between merged and LoRA batches only swaps parameters (merged_weights.py).
        Turn it off to save that memory (a small notebook server).
    decoding: "slots" (default): decode from fixed per-row KV buffers (hf/slots.py), which on CUDA replay each
        step as a CUDA graph, wherever the model passes the engine's start check (full attention; the same
        logprobs as the dynamic cache), else the dynamic way; "dynamic": a growing cache for every batch. The
        engine's log and `stats()["decoding"]` say which runs and why. cuda_graphs: replay slot steps as CUDA
        graphs on a GPU (default True; off decodes the same slots eagerly).
    omp_wait_policy: how the server's OpenMP threads wait between parallel regions (see OMP_POLICIES).
        "auto" (default): AUTO_OMP_ENV, chosen by benchmarks/omp_wait_policy.py, unless OMP_WAIT_POLICY or
        GOMP_SPINCOUNT is set in this process's environment, which then wins; "active": spin (fastest on
        an idle machine, very slow when other processes keep the cores busy); "passive": sleep at once.
    """

    kind = "HF"

    def __init__(
        self,
        model_path: str | Path,
        served_name: str,
        log_dir: str | Path,
        *,
        device: str = "auto",
        max_batch_size: int = 32,
        max_loras: int = 4,
        port: int | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        trust_request_chat_template: bool = False,
        control_timeout_s: float = 60.0,
        hold_timeout_s: float = 900.0,
        start_timeout_s: float | None = None,
        unanswered_s: float = 60.0,
        merge_newest: bool | None = None,
        decoding: str = "slots",
        cuda_graphs: bool = True,
        omp_wait_policy: str = "auto",
        chat_template: str | None = None,
        default_chat_template_kwargs: Mapping[str, Any] | None = None,
    ):
        if decoding not in DECODINGS:
            raise ValueError(
                f"decoding={decoding!r}: pass one of {DECODINGS} (slots: fixed buffers, CUDA graphs on a GPU; "
                f"dynamic: a growing cache)"
            )
        if omp_wait_policy not in OMP_POLICIES:
            raise ValueError(
                f"omp_wait_policy={omp_wait_policy!r}: pass one of {list(OMP_POLICIES)} "
                f"(auto: measured choice; active: spin, for an idle machine; passive: sleep, for a busy one)"
            )
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
        self.device, self.max_batch_size, self.max_loras = device, max_batch_size, max_loras
        self.trust_request_chat_template = trust_request_chat_template
        self.merge_newest, self.omp_wait_policy = merge_newest, omp_wait_policy
        self.decoding, self.cuda_graphs = decoding, cuda_graphs

    async def start(self, timeout: float | None = None) -> None:
        """Launch the server and wait until it serves; the event loop keeps running meanwhile."""
        self._claim_port()
        omp = omp_environment(self.omp_wait_policy)
        # The key is not on the command line, where `ps` shows it.
        env = self._server_env({API_KEY_ENV: self.api_key, **omp})
        if omp:  # ours replaces the user's whole: libgomp lets GOMP_SPINCOUNT override OMP_WAIT_POLICY
            for key in set(OMP_ENV_KEYS) - omp.keys():
                env.pop(key, None)
        merge = {None: [], True: ["--merge-newest"], False: ["--no-merge-newest"]}[self.merge_newest]
        template = self._chat_template_args()

        def command() -> list[str]:  # for self.port, which a taken port changes
            return [
                sys.executable, "-m", "artnb.backends.engines.hf.server",
                "--model", self.model_path,
                "--served-name", self.served_name,
                "--port", str(self.port),
                "--device", self.device,
                "--max-batch-size", str(self.max_batch_size),
                "--max-loras", str(self.max_loras),
                "--max-request-bytes", str(self.max_request_bytes),
                *(["--trust-request-chat-template"] if self.trust_request_chat_template else []),
                *template,
                *merge,
                "--decoding", self.decoding,
                "--cuda-graphs" if self.cuda_graphs else "--no-cuda-graphs",
                "--parent-pid", str(os.getpid()),  # it may be orphaned before it starts watching
            ]  # fmt: skip

        timeout = timeout or self.start_timeout_s or 300
        await self._launch_until_ready(command, env, timeout)

    async def load_adapter(self, lora_name: str, lora_path: str) -> None:
        """Load a PEFT adapter directory under `lora_name` (replacing one of that name)."""
        await self._call(
            "POST", "/v1/load_lora_adapter", {"lora_name": lora_name, "lora_path": str(lora_path)}
        )

    async def unload_adapter(self, lora_name: str) -> None:
        await self._call("POST", "/v1/unload_lora_adapter", {"lora_name": lora_name})

    async def hold(self) -> None:
        """Pause scheduling: new requests wait (they do not fail); returns once in-flight batches finished.

        Raises TimeoutError after hold_timeout_s, having released the engine (best effort)."""
        await self._hold()

    async def release(self) -> None:
        await self._call("POST", "/artnb/release")

    async def stats(self) -> dict[str, Any]:
        """Counters: requests, rows, batches run, whether held, loaded adapters, and rows cut short because
        their client disconnected (aborted_rows: left a running batch; dropped_rows: never ran)."""
        return await self._call("GET", "/artnb/stats")
