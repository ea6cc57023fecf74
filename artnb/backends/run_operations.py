"""Operations on a run directory besides training: fork from another run's checkpoint, push to and pull from S3,
delete old checkpoints; and `RunOperations`, which gives LocalBackend them under ART's names
(`_experimental_fork_checkpoint`, `_experimental_push_to_s3`, `_experimental_pull_from_s3`,
`_experimental_pull_model_checkpoint`, `delete_checkpoints`).

Each one is the run's only writer while it works: on a registered model it waits for the model's running step
(`ServedModel.step_lock`), on any other run it takes the run's lock (run_writers.as_writer).
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import statistics
import threading
from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, TypeVar, overload

import pandas as pd

from ..core import metric_names as names
from ..core.ignored import report_ignored, warn_user
from ..core.model import Model, TrainableModel
from ..core.retention import CheckpointInfo, CheckpointRetentionContext, CheckpointRetentionStrategy
from ..core.store import RunStore, copy_checkpoint_files
from . import s3
from .served import ServedModel

T = TypeVar("T")
AsWriter = Callable[[RunStore, Callable[[], T]], Awaitable[T]]


async def fork_checkpoint(
    source: RunStore,
    target: RunStore,
    served: ServedModel | None,
    as_writer: AsWriter,
    *,
    from_s3_bucket: str | None = None,
    prefix: str | None = None,
    not_after_step: int | None = None,
    verbose: bool = False,
) -> int:
    """Copy `source`'s newest checkpoint not after `not_after_step` into `target` (a run that has not trained),
    pulled from S3 first when `from_s3_bucket` is given; a registered target (`served`) trains and serves it at
    once. Returns the step forked."""
    if from_s3_bucket is not None:  # as ART: bring the source's checkpoint from the bucket first
        bucket = s3.resolve_bucket(from_s3_bucket)
        await as_writer(
            source, lambda: s3.pull(source, bucket, prefix, not_after_step=not_after_step, verbose=verbose)
        )
    elif prefix is not None:
        report_ignored("_experimental_fork_checkpoint(prefix=...)", "it is the S3 prefix of from_s3_bucket")
    steps = [s for s in source.steps() if not_after_step is None or s <= not_after_step]
    if not steps:
        raise FileNotFoundError(
            f"no checkpoint of {source.project}/{source.name} in {source.root}"
            + (f" at or before step {not_after_step}" if not_after_step is not None else "")
            + f"; its checkpoints: {source.steps()}"
        )
    forked = steps[-1]
    if served is None:  # ART's docs fork before register(), which then resumes from the forked step
        await as_writer(target, lambda: _copy_fork(source, forked, target))
    else:
        async with served.step_lock:
            await asyncio.to_thread(_copy_fork, source, forked, served.store)
            await served.load_checkpoint(forked)
    if verbose:
        print(f"forked {source.project}/{source.name} step {forked} into {target.project}/{target.name}")
    return forked


def _copy_fork(source: RunStore, step: int, target: RunStore) -> None:
    """Copy `source`'s checkpoint `step` into `target`, a run that has not trained (at most its step 0)."""
    if target.steps() not in ([], [0]):
        raise ValueError(
            f"{target.project}/{target.name} has trained already (checkpoints {target.steps()}); fork into a new "
            "model name so the two runs' steps do not mix"
        )
    if step == 0 and target.steps() == [0]:
        target.delete_checkpoint(0)
    src = source.checkpoint_path(step)
    target.write_checkpoint(step, lambda tmp: copy_checkpoint_files(src, tmp))


async def push_to_s3(
    store: RunStore,
    served: ServedModel | None,
    s3_bucket: str | None,
    prefix: str | None,
    *,
    verbose: bool,
    delete: bool,
) -> s3.SyncReport:
    """Upload the run's committed steps (see backends/s3.py). No step commits while it runs; a cancelled push
    stops after the current file and removes what it uploaded of an unfinished step."""
    bucket = s3.resolve_bucket(s3_bucket)
    stop = threading.Event()
    async with served.step_lock if served is not None else contextlib.nullcontext():
        work = asyncio.ensure_future(
            asyncio.to_thread(s3.push, store, bucket, prefix, delete=delete, verbose=verbose, stop=stop)
        )
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            stop.set()
            with contextlib.suppress(BaseException):
                await work  # the upload in flight finishes and the unfinished step is removed
            raise


async def pull_from_s3(
    store: RunStore,
    as_writer: AsWriter,
    s3_bucket: str | None,
    prefix: str | None,
    *,
    step: int | Literal["latest"] | None,
    verbose: bool,
    delete: bool,
    exclude: Iterable[str] | None = None,
) -> s3.SyncReport:
    """Download the run from S3 into `store` (every complete step, or only `step`; not the folders in
    `exclude`), as its writer."""
    bucket = s3.resolve_bucket(s3_bucket)
    excluded = s3.check_exclude(exclude)  # before taking the run's lock: a bad name is the caller's error
    return await as_writer(
        store,
        lambda: s3.pull(store, bucket, prefix, step=step, delete=delete, verbose=verbose, exclude=excluded),
    )


async def pull_model_checkpoint(
    store: RunStore,
    served: ServedModel | None,
    as_writer: AsWriter,
    *,
    step: int | Literal["latest"] | None,
    local_path: str | Path | None,
    s3_bucket: str | None,
    prefix: str | None,
    verbose: bool,
) -> str:
    """The directory of one checkpoint of `store`'s run: taken from the run directory when it is there, else
    pulled from S3 (that checkpoint alone); copied into `local_path` when given. See
    RunOperations._experimental_pull_model_checkpoint."""
    bucket = s3.resolve_bucket(s3_bucket) if s3_bucket is not None else None
    wanted = await _checkpoint_to_pull(store, step, bucket, prefix, verbose)
    if wanted not in store.steps():
        if bucket is None:
            raise FileNotFoundError(
                f"checkpoint {wanted} of {store.project}/{store.name} is not in {store.checkpoints} (its "
                f"checkpoints: {store.steps()}); pass s3_bucket=... to pull it from S3"
            )
        if served is not None:
            raise RuntimeError(
                f"{store.project}/{store.name} is registered and serving on this backend, and checkpoint {wanted} "
                "is only in S3: pull it before `await model.register(backend)` or after `await backend.close()`"
            )
        await as_writer(store, lambda: s3.pull(store, bucket, prefix, step=wanted, verbose=verbose))
    source = store.checkpoint_path(wanted)
    if local_path is None:
        return str(source)
    target = Path(local_path)
    await asyncio.to_thread(_copy_checkpoint_out, source, target)
    if verbose:
        print(f"copied checkpoint {wanted} of {store.project}/{store.name} to {target}")
    return str(target)


async def _checkpoint_to_pull(
    store: RunStore,
    step: int | Literal["latest"] | None,
    bucket: str | None,
    prefix: str | None,
    verbose: bool,
) -> int:
    """`step` as a number: for "latest" (or None), the newest of the run directory's and the bucket's, the
    run directory's when they are level (as in ART)."""
    if isinstance(step, int) and not isinstance(step, bool):
        return step
    if step not in (None, "latest"):
        raise ValueError(f"step={step!r}: pass a step number or 'latest'")
    local = store.latest_step()
    remote = await asyncio.to_thread(s3.latest_remote_step, store, bucket, prefix) if bucket else None
    if local is None and remote is None:
        where = f"{store.checkpoints}" + (
            f" or s3://{bucket}/{s3.s3_prefix(store.project, store.name, prefix)}" if bucket else ""
        )
        raise FileNotFoundError(f"no checkpoint of {store.project}/{store.name} in {where}")
    latest = max(s for s in (local, remote) if s is not None)
    if verbose:
        print(
            f"latest checkpoint of {store.project}/{store.name}: step {latest} "
            f"({'run directory' if latest == local else 'S3'})"
        )
    return latest


def _copy_checkpoint_out(source: Path, target: Path) -> None:
    """The checkpoint's files (adapter and optimizer state) into `target`, created if need be."""
    target.mkdir(parents=True, exist_ok=True)
    copy_checkpoint_files(source, target)


async def delete_checkpoints(served: ServedModel, best_checkpoint_metric: str) -> list[int]:
    """Keep the latest checkpoint and the best by `best_checkpoint_metric` (its mean per step); delete the rest.
    Returns the deleted steps."""
    async with served.step_lock:
        store = served.store
        steps = store.steps()
        if not steps:
            return []
        keep = {steps[-1]}
        history = store.history()
        _check_metric_known(best_checkpoint_metric, history.columns)
        if best_checkpoint_metric in history.columns:
            rows = history[["step", best_checkpoint_metric]].dropna()
            rows = rows[rows["step"].isin(steps)]
            if len(rows):
                means: Any = rows.groupby("step")[best_checkpoint_metric].agg(statistics.fmean)
                keep.add(int(means.idxmax()))
        else:
            warn_user(
                f"no {best_checkpoint_metric!r} in the history; keeping only the latest checkpoint. "
                f"Log it with `await model.log(groups, split='val')` to keep the best one too."
            )
        deleted = [s for s in steps if s not in keep]
        for s in deleted:
            store.delete_checkpoint(s)
        return deleted


async def retain_checkpoints(
    served: ServedModel, strategy: CheckpointRetentionStrategy, current_step: int, protected: Iterable[int]
) -> list[int]:
    """Delete the checkpoints `strategy` does not keep among those it is offered: every one but the newest and
    the `protected` steps. Returns the deleted steps."""
    async with served.step_lock:
        store = served.store
        kept = set(protected)
        offered = [s for s in store.steps()[:-1] if s not in kept]
        if not offered:
            return []
        history = await asyncio.to_thread(store.history)
        if (metric := getattr(strategy, "metric", None)) is not None:
            _check_metric_known(metric, history.columns, "keep_recent_and_top(metric=...)")
        infos = _checkpoint_infos(store, history, offered)
        keep = set(strategy(CheckpointRetentionContext(current_step=current_step, checkpoints=infos)))
        deleted = [s for s in offered if s not in keep]
        for s in deleted:
            await asyncio.to_thread(store.delete_checkpoint, s)
        return deleted


def _checkpoint_infos(store: RunStore, history: pd.DataFrame, steps: list[int]) -> list[CheckpointInfo]:
    """The checkpoints `steps` with the `history`'s numeric means at each step (evaluations logged there)."""
    infos = []
    for s in steps:
        rows = history[history["step"] == s]
        means = rows.select_dtypes("number").drop(columns=["step"], errors="ignore").mean()
        path = store.checkpoint_path(s)
        infos.append(
            CheckpointInfo(
                step=s,
                path=str(path),
                created_at=datetime.fromtimestamp(path.stat().st_mtime, tz=timezone.utc),
                is_eval_step=bool(set(rows["split"].dropna()) - {"train"}),
                metrics={str(k): float(v) for k, v in means.items() if pd.notna(v)},
            )
        )
    return infos


def _check_metric_known(
    metric: str, columns: Iterable[str], what: str = "delete_checkpoints(best_checkpoint_metric=...)"
) -> None:
    """A metric missing from the history keeps only the latest checkpoint (with a warning), as in ART: a
    validation metric a weak model has not scored yet (ART's art-e logs `val/correct` only for answered games) is
    not an error. A near miss of a metric of the same split (`val/accuracy` for `val/acc`) is a typo, and
    keeping only the latest would delete the best checkpoint for good: refused before anything is deleted."""
    if metric == names.BEST_CHECKPOINT_METRIC or metric in columns:
        return
    split, _, short = metric.rpartition("/")
    close = [c for c in columns if c.rpartition("/")[0] == split and _near(c.rpartition("/")[2], short)]
    if close:
        raise ValueError(
            f"{what.replace('...', repr(metric))}: the run's history has no {metric!r}, so the "
            f"best checkpoint by it cannot be found, and nothing was deleted. Did you mean "
            f"{' or '.join(map(repr, close))}?"
        )


def _near(a: str, b: str) -> bool:
    """Two metric names one could be a slip for the other: one cut short (acc, accuracy) or a typo."""
    return bool(a and b) and (
        a.startswith(b) or b.startswith(a) or difflib.SequenceMatcher(None, a, b).ratio() >= 0.8
    )


class RunOperations:
    """ART's run operations, for a backend that keeps a ServedModel per registered model (LocalBackend)."""

    path: Path

    @overload
    def served_model(self, model: Model, required: Literal[True]) -> ServedModel: ...
    @overload
    def served_model(self, model: Model, required: bool = False) -> ServedModel | None: ...
    def served_model(self, model: Model, required: bool = False) -> ServedModel | None:
        """The model's slot if it is registered here (else None, or an error when `required`)."""
        raise NotImplementedError

    async def as_writer(self, store: RunStore, work: Callable[[], T]) -> T:
        """Run `work()` in a thread as the run's one writer."""
        raise NotImplementedError

    async def _experimental_fork_checkpoint(
        self,
        model: TrainableModel,
        from_model: str,
        from_project: str | None = None,
        from_s3_bucket: str | None = None,
        not_after_step: int | None = None,
        verbose: bool = False,
        prefix: str | None = None,
    ) -> int:
        """Start `model` from another run's checkpoint: the newest one of `from_model` (in `from_project`, default
        the model's own) not after `not_after_step`. Returns the step forked; the model continues from it.

        As in ART the checkpoint keeps its step number, so the fork's step counter continues the source's. Unlike
        ART it refuses to fork into a run that has trained already (mixing two runs' steps), and the forked
        checkpoint is loaded into the trainer and served at once. `from_s3_bucket`/`prefix`: pulled from S3 first.
        """
        return await fork_checkpoint(
            RunStore(self.path, from_project or model.project, from_model),
            RunStore(self.path, model.project, model.storage_name),
            self.served_model(model),
            self.as_writer,
            from_s3_bucket=from_s3_bucket,
            prefix=prefix,
            not_after_step=not_after_step,
            verbose=verbose,
        )

    async def _experimental_push_to_s3(
        self,
        model: Model,
        s3_bucket: str | None = None,
        prefix: str | None = None,
        verbose: bool = False,
        delete: bool = False,
    ) -> s3.SyncReport:
        """Upload the model's run directory to `s3://{bucket}/{prefix}/{project}/models/{name}/` (ART's layout):
        committed steps only, each step's weights last (see backends/s3.py). `s3_bucket` defaults to
        $BACKUP_BUCKET; `delete=True` removes objects the run directory no longer has. No step commits while
        it runs; a cancelled push stops after the current file and removes what it uploaded of an unfinished step.
        """
        store = RunStore(self.path, model.project, model.storage_name)
        served = self.served_model(model)
        return await push_to_s3(store, served, s3_bucket, prefix, verbose=verbose, delete=delete)

    async def _experimental_pull_from_s3(
        self,
        model: Model,
        step: int | Literal["latest"] | None = None,
        s3_bucket: str | None = None,
        prefix: str | None = None,
        verbose: bool = False,
        delete: bool = False,
        *,
        only_step: int | Literal["latest"] | None = None,
        latest_only: bool = False,
        exclude: list[s3.Excludable] | None = None,
    ) -> s3.SyncReport:
        """Download the model's run from S3 into this backend's path, before `model.register(backend)` (as in
        ART's scripts): every complete step, history and trajectories; or one checkpoint alone: `only_step` (a
        step, or "latest" for the newest; ART's newer name for `step`), `latest_only=True` as "latest". Each step
        arrives whole (temp directory, then rename); steps whose weights never reached the bucket are ignored. A
        local step or history that differs from the bucket's is an error unless `delete=True`, which makes the
        local run the bucket's copy. `exclude`: folders of the run not to pull ("checkpoints", "logs",
        "trajectories"). ART 0.5.23 deprecates this method for `_experimental_pull_model_checkpoint`, which
        gives the path of one checkpoint."""
        wanted = s3.one_step(step, only_step, latest_only)
        if self.served_model(model) is not None:
            raise RuntimeError(
                f"{model.project}/{model.storage_name} is registered and serving on this backend: pull before "
                "`await model.register(backend)` (its trainer would not see the pulled steps), or "
                "`await backend.close()` first"
            )
        store = RunStore(self.path, model.project, model.storage_name)
        return await pull_from_s3(
            store,
            self.as_writer,
            s3_bucket,
            prefix,
            step=wanted,
            verbose=verbose,
            delete=delete,
            exclude=exclude,
        )

    async def _experimental_pull_model_checkpoint(
        self,
        model: Model,
        *,
        step: int | Literal["latest"] | None = None,
        local_path: str | None = None,
        s3_bucket: str | None = None,
        prefix: str | None = None,
        verbose: bool = False,
    ) -> str:
        """The local directory of one checkpoint of `model`, e.g. to load it elsewhere (vLLM, PEFT). `step`: a
        number, or "latest"/None for the newest in this backend's run directory or (with `s3_bucket`) the
        bucket, the local one when they are level. A checkpoint missing here is pulled from S3 (that checkpoint
        alone, whole); `local_path`: its adapter and optimizer files are copied into that directory, which is
        returned instead of the run directory's. A registered model's run may only pull a checkpoint while
        not serving (the trainer would not see it)."""
        return await pull_model_checkpoint(
            RunStore(self.path, model.project, model.storage_name),
            self.served_model(model),
            self.as_writer,
            step=step,
            local_path=local_path,
            s3_bucket=s3_bucket,
            prefix=prefix,
            verbose=verbose,
        )

    async def _retain_checkpoints(
        self,
        model: TrainableModel,
        strategy: CheckpointRetentionStrategy,
        current_step: int,
        protected: Iterable[int] = (),
    ) -> list[int]:
        """PipelineTrainer's checkpoint retention (core/retention.py): delete what `strategy` does not keep of
        the checkpoints before the newest, `protected` steps left out. Returns the deleted steps."""
        return await retain_checkpoints(
            self.served_model(model, required=True), strategy, current_step, protected
        )

    async def delete_checkpoints(
        self, model: TrainableModel, best_checkpoint_metric: str = names.BEST_CHECKPOINT_METRIC
    ) -> list[int]:
        """Keep the latest checkpoint and the best by `best_checkpoint_metric`; delete the rest. Returns deleted steps."""
        return await delete_checkpoints(self.served_model(model, required=True), best_checkpoint_metric)
