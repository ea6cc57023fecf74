"""`art.utils`: the helpers ART notebooks import from `art.utils`, with the same calls.

- `iterate_dataset`, `DatasetBatch`: resumable, deterministically shuffled training batches.
- `limit_concurrency`: cap concurrent calls of an async function (per key).
- `strip_logprobs`: a copy of any object without per-token logprobs (for trace viewers such as Weave).
- `retry`: the same decorator as `art.retry` (artnb.core.gather), re-exported because ART has it here too.

Submodules, imported by path as in ART: `artnb.utils.litellm` (`convert_litellm_choice_to_openai`),
`artnb.utils.output_dirs` (run-directory paths), `artnb.utils.benchmarking` (load_trajectories and charts,
plotly and pandas), `artnb.utils.logging` (`info, ok, step, warn, err`), `artnb.utils.get_trajectory_messages`,
`artnb.utils.get_repo_root_path`, `artnb.utils.benchmark_rollout` and `artnb.utils.s3` (`pull_model_from_s3`).
They are not imported here, so `import artnb` stays free of plotly.
"""

from ..core.gather import retry
from .iterate_dataset import DatasetBatch, iterate_dataset
from .limit_concurrency import limit_concurrency
from .strip_logprobs import strip_logprobs

__all__ = ["DatasetBatch", "iterate_dataset", "limit_concurrency", "retry", "strip_logprobs"]
