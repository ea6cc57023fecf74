"""`art.utils`: the helpers ART notebooks import from `art.utils`, with the same calls.

- `iterate_dataset`, `DatasetBatch`: resumable, deterministically shuffled training batches.
- `limit_concurrency`: cap concurrent calls of an async function (per key).
- `strip_logprobs`: a copy of any object without per-token logprobs (for trace viewers such as Weave).
- `retry`: the same decorator as `art.retry` (artnb.core.gather), re-exported because ART has it here too (and
  at `artnb.utils.retry.retry`).
- `get_model_step`: a run's newest checkpoint step, read from disk; `format_message`: a chat message as text;
  `log_http_errors`: HTTP errors re-raised with the server's detail; `record_provenance`: a note on a W&B LoRA
  artifact.

Submodules: `artnb.utils.litellm` (`convert_litellm_choice_to_openai`), `artnb.utils.output_dirs` (run-directory
paths), `artnb.utils.benchmarking` (load_trajectories and charts, plotly and pandas), `artnb.utils.logging`
(`info, ok, step, warn, err`), `artnb.utils.get_trajectory_messages`, `artnb.utils.get_repo_root_path`,
`artnb.utils.benchmark_rollout`, `artnb.utils.sft` and `artnb.utils.s3` (`pull_model_from_s3`). They are imported
by path or on first use as attributes (`art.utils.s3`), so `import artnb` stays free of plotly, pandas and boto3.
"""

import importlib
from types import ModuleType

from .format_message import format_message
from .get_model_step import get_model_step
from .iterate_dataset import DatasetBatch, iterate_dataset
from .limit_concurrency import limit_concurrency
from .log_http_errors import log_http_errors
from .record_provenance import record_provenance
from .retry import retry
from .strip_logprobs import strip_logprobs

# imported on first attribute access (PEP 562): their dependencies are heavy or optional
_LAZY_SUBMODULES = frozenset(
    """benchmark_rollout benchmarking get_repo_root_path get_trajectory_messages litellm logging output_dirs s3
    sft""".split()
)


def __getattr__(name: str) -> ModuleType:
    if name not in _LAZY_SUBMODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return importlib.import_module(f".{name}", __name__)  # the import binds it here too


__all__ = [
    "DatasetBatch",
    "format_message",
    "get_model_step",
    "iterate_dataset",
    "limit_concurrency",
    "log_http_errors",
    "record_provenance",
    "retry",
    "strip_logprobs",
]
