"""`art.utils.s3.pull_model_from_s3`: ART's function for fetching a run from S3 without a backend, as its
benchmark notebooks do before loading trajectories. The copy is LocalBackend's pull (backends/s3.py): whole
steps only, boto3, no AWS CLI needed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from .output_dirs import DEFAULT_ART_PATH

if TYPE_CHECKING:
    from ..backends.s3 import Excludable


async def pull_model_from_s3(
    model_name: str,
    project: str,
    step: int | Literal["latest"] | None = None,
    s3_bucket: str | None = None,
    prefix: str | None = None,
    verbose: bool = False,
    delete: bool = False,
    art_path: str | None = None,
    exclude: list[Excludable] | None = None,
) -> str:
    """Download run `project/model_name` from `s3_bucket` (default $BACKUP_BUCKET) into `art_path` (default
    ./.art): every complete step with the history and trajectories, or only checkpoint `step` ("latest": the
    newest). `delete=True` replaces a local run that differs from the bucket's. `exclude`: folders of the run
    not to pull, e.g. `["checkpoints"]` to read only trajectories and history. Returns the run directory."""
    from ..backends.local import LocalBackend
    from ..backends.run_operations import pull_from_s3
    from ..core.store import RunStore

    backend = LocalBackend(path=art_path or DEFAULT_ART_PATH)  # serves nothing: it only takes the run's lock
    store = RunStore(backend.path, project, model_name)
    try:
        await pull_from_s3(
            store,
            backend.as_writer,
            s3_bucket,
            prefix,
            step=step,
            verbose=verbose,
            delete=delete,
            exclude=exclude,
        )
    finally:
        await backend.close()
    return str(store.dir)
