"""ART's helpers for where a run's files live, answered by artnb's `RunStore`.

Notebooks and scripts written for ART build paths with these (`get_step_checkpoint_dir(model_dir, step)` to
load an adapter, `get_trajectories_split_dir(...)` to read logged rollouts). Here every function asks
`artnb.core.store.RunStore`, the one place that knows the run-directory layout, so they can never disagree with
what artnb writes:

    {art_path}/{project}/models/{name}/checkpoints/{step:04d}
    {art_path}/{project}/models/{name}/trajectories/{split}/{step:04d}.parquet

where a model's `name` here is its run: `run_name` when given, else `name` (`model.storage_name`).

Departures from OpenPipe ART's `art.utils.output_dirs`:
- `art_path=None` means "./.art", where `art.Model` and `art.LocalBackend` write by default. ART walks up from
  its installed package looking for a `.git` folder, which lands outside the notebook's folder when ART is
  installed from PyPI. `get_model_dir(model)` uses the model's own `base_path`.
- Paths come back absolute (ART joins strings, so a relative `art_path` stays relative).
- `get_step_checkpoint_dir` includes the `checkpoints/` folder (ART 0.4+ layout; ART 0.3 put steps directly in
  the model directory).
- Project and model names are checked (a name with '/' or '@' raises ValueError with the rule).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..core.store import RunStore

if TYPE_CHECKING:
    from ..core.model import Model

DEFAULT_ART_PATH = "./.art"  # the default of art.Model(base_path=...) and art.LocalBackend(path=...)


def get_default_art_path() -> str:
    """The folder runs are written to when no path is given: ./.art under the current directory."""
    return str(Path(DEFAULT_ART_PATH).resolve())


def get_output_dir_from_model_properties(project: str, name: str, art_path: str | Path | None = None) -> str:
    """The run directory of model `name` in `project`: `{art_path}/{project}/models/{name}`."""
    return str(_store(project, name, art_path).dir)


def get_model_dir(model: Model, art_path: str | Path | None = None) -> str:
    """The run directory of `model` (under `art_path` if given, else under the model's `base_path`)."""
    return str(
        RunStore(art_path if art_path is not None else model.base_path, model.project, model.storage_name).dir
    )


def get_models_dir(project_name: str, art_path: str | Path | None = None) -> str:
    """The folder holding every model's run directory of a project: `{art_path}/{project_name}/models`."""
    return str(_store(project_name, "any", art_path).dir.parent)  # a run directory's parent, for any name


def get_step_checkpoint_dir(model_output_dir: str | Path, step: int) -> str:
    """The checkpoint folder (LoRA adapter) of `step` in a run directory: `.../checkpoints/{step:04d}`."""
    return str(RunStore.from_dir(model_output_dir).checkpoint_path(step))


def get_trajectories_dir(model_output_dir: str | Path) -> str:
    """The folder holding a run's logged trajectories, one subfolder per split."""
    return str(RunStore.from_dir(model_output_dir).trajectories_dir("any").parent)


def get_trajectories_split_dir(model_output_dir: str | Path, split: str) -> str:
    """The folder of one split's trajectory files, `{step:04d}.parquet` each."""
    return str(RunStore.from_dir(model_output_dir).trajectories_dir(split))


def _store(project: str, name: str, art_path: str | Path | None) -> RunStore:
    return RunStore(art_path if art_path is not None else DEFAULT_ART_PATH, project, name)
