"""Code that runs inside vLLM's worker process, loaded with `--worker-extension-cls` (see vllm/client.py).

Why its own module: vLLM imports it into the worker by its path, apart from the server (vllm/server.py) and the
client. `MergedServing.artnb_serve_merged(adapter_dir)` reloads the model's weights in place from its base
checkpoint with the adapter's deltas added (merged_weights.py), through vLLM's own in-place reload, which also
redoes what vLLM does to weights after loading (on a CPU: the prepacked GEMM weights). An empty `adapter_dir`
restores the base weights. It is called through vLLM's `/collective_rpc` route, which only passes strings; the
engine holds requests while it runs and resets the prefix cache after, since cached KV blocks belong to the old
weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from artnb.backends.engines.merged_weights import merged_checkpoint, read_adapter


class MergedServing:
    """A mix-in for vLLM's worker class (vLLM adds it to the worker's bases)."""

    model_runner: Any  # the worker's (vLLM's), as is reload_weights
    reload_weights: Callable[..., object]

    def artnb_serve_merged(self, adapter_dir: str = "") -> dict:
        started = time.perf_counter()
        model_dir = self.model_runner.model_config.model
        adapter = read_adapter(adapter_dir) if adapter_dir else None
        self.reload_weights(weights_iterator=merged_checkpoint(model_dir, adapter), is_checkpoint_format=True)
        return {"adapter": adapter_dir, "seconds": time.perf_counter() - started}
