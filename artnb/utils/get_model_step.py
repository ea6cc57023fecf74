"""ART's `art.utils.get_model_step`: a model's newest trained step, read from its run directory on disk.

Unlike `await model.get_step()`, it needs no backend: a notebook can see how far a run got (or pick the step a
resumed loop starts at) before registering anything. The step is that of the newest committed checkpoint
(RunStore decides what counts: a checkpoint folder with its adapter files), 0 for a run with none.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..core.model import Model


def get_step_from_dir(output_dir: str | Path) -> int:
    """The newest committed checkpoint's step in the run directory `output_dir` (0 when it has none)."""
    from ..core.store import RunStore  # pandas: when asked, not at `import artnb.utils`

    return RunStore.from_dir(output_dir).latest_step() or 0


def get_model_step(model: Model, art_path: str | Path | None = None) -> int:
    """The newest committed checkpoint's step of `model`'s run under `art_path` (default: the model's own
    `base_path`, where it trains); 0 for a run that has not trained yet."""
    from ..core.store import RunStore

    root = art_path if art_path is not None else model.base_path
    return RunStore(root, model.project, model.storage_name).latest_step() or 0
