"""Code that runs inside vLLM's worker process, loaded with `--worker-extension-cls` (see vllm_engine.py).

`MergedWeights.artnb_serve_merged(adapter_dir)` reloads the model's weights in place from its base checkpoint
with the adapter's deltas added (lora_merge.py), through vLLM's own in-place reload, which also redoes what
vLLM does to weights after loading (on a CPU: the prepacked GEMM weights). An empty `adapter_dir` restores the
base weights. It is called through vLLM's `/collective_rpc` route, which only passes strings; the engine holds
requests while it runs and resets the prefix cache after, since cached KV blocks belong to the old weights.
"""

from __future__ import annotations

import time

from artnb.backends.engines.lora_merge import merged_weights, read_adapter


class MergedWeights:
    """A mix-in for vLLM's worker class (vLLM adds it to the worker's bases)."""

    def artnb_serve_merged(self, adapter_dir: str = "") -> dict:
        started = time.perf_counter()
        model_dir = self.model_runner.model_config.model
        adapter = read_adapter(adapter_dir) if adapter_dir else None
        self.reload_weights(weights_iterator=merged_weights(model_dir, adapter), is_checkpoint_format=True)
        return {"adapter": adapter_dir, "seconds": time.perf_counter() - started}
