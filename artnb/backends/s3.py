"""Run directories copied to and from S3: ART's `backend._experimental_push_to_s3` / `_experimental_pull_from_s3`.

The bucket holds ART's layout, `s3://{bucket}/{prefix}/{project}/models/{name}/...`, one object per file of the
run directory (checkpoints, history.jsonl, trajectories, model.json, state.json). ART shells out to
`aws s3 sync`; artnb uses boto3, so there is no CLI to install and an S3-compatible endpoint (MinIO, R2, a local
test server) is chosen with boto3's own `AWS_ENDPOINT_URL`.

Why steps arrive whole. S3 has no rename and no multi-object transaction, so the rule is the one `RunStore` uses
on disk: a checkpoint is a step when its adapter weights (`adapter_model.safetensors`) are there. Push uploads
a step's other files first and its weights last, as one object that S3 shows whole or not at all; a push that
is interrupted in this process removes what it uploaded of an unfinished step, and one that is killed leaves
objects without weights, which pull ignores and the next push completes. Pull downloads a step into a temp
directory beside the checkpoints and renames it into place, so a run directory never holds a partial step.
Only committed steps are pushed (never a step being written).

`delete=True` has `aws s3 sync --delete`'s meaning, as in ART: push removes objects the run directory no longer
has (e.g. checkpoints `delete_checkpoints` removed); pull removes local files and steps the bucket does not have.
Unlike ART, pull refuses to overwrite a local step or history that differs from the bucket's (two runs under one
name) unless `delete=True`, and never creates a bucket.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from tqdm.auto import tqdm

from ..core.atomic import publish_dir, write_atomic
from ..core.store import ADAPTER_FILES, RunStore

WEIGHTS = ADAPTER_FILES[1]  # adapter_model.safetensors: uploaded last; its presence makes a step
BUCKET_ENV = "BACKUP_BUCKET"  # ART's default bucket variable
_SKIPPED = {".lock", "wandb"}  # the writer lock belongs to this machine; W&B keeps its own copy of its files
Excludable = Literal[
    "checkpoints", "logs", "trajectories"
]  # ART's `exclude` options: top-level folders of a run
EXCLUDABLE: tuple[Excludable, ...] = get_args(Excludable)


class S3SyncError(RuntimeError):
    """An S3 call failed (the message names the bucket, the key and S3's reason)."""


@dataclass
class SyncReport:
    """What a push or pull did."""

    uploaded: list[str] = field(default_factory=list)
    downloaded: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # steps that are complete at the destination
    ignored_partial_steps: list[int] = field(default_factory=list)  # in the bucket without their weights


def s3_prefix(project: str, name: str, prefix: str | None = None) -> str:
    """The key prefix of a run, ending in '/': `{prefix}/{project}/models/{name}/` (ART's layout)."""
    head = f"{prefix.strip('/')}/" if prefix and prefix.strip("/") else ""
    return f"{head}{project}/models/{name}/"


def resolve_bucket(s3_bucket: str | None) -> str:
    bucket = s3_bucket or os.environ.get(BUCKET_ENV)
    if not bucket:
        raise ValueError(
            f"no S3 bucket: pass s3_bucket='my-bucket' or set ${BUCKET_ENV} (as with ART). Credentials and the "
            "endpoint come from boto3's usual settings (AWS_ACCESS_KEY_ID, AWS_PROFILE, AWS_ENDPOINT_URL ...)"
        )
    return bucket.removeprefix("s3://").strip("/")


def s3_client() -> Any:
    """A boto3 S3 client from the environment's settings (credentials, region, `AWS_ENDPOINT_URL`)."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError as error:
        raise ImportError(
            f"S3 checkpoints need boto3 ({error}): pip install 'artnb[s3]' (or pip install boto3)"
        ) from None
    return boto3.client("s3", config=Config(retries={"mode": "standard", "max_attempts": 5}))


# listing ------------------------------------------------------------------------------------------------
def _relative(store: RunStore, step: int, name: str | None = None) -> str:
    """Checkpoint `step`'s directory (or its file `name`) relative to the run directory, as S3 keys are."""
    path = store.checkpoint_path(step).relative_to(store.dir)
    return (path / name if name else path).as_posix()


def _local_files(store: RunStore) -> dict[str, Path]:
    """The run directory's files to copy, by relative path: committed steps only, no temp files, no lock."""
    files: dict[str, Path] = {}
    if not store.dir.is_dir():
        return files
    steps = set(store.steps())
    for path in sorted(store.dir.rglob("*")):
        rel = path.relative_to(store.dir).as_posix()
        if (
            not path.is_file()
            or rel.split("/")[0] in _SKIPPED
            or any(p.startswith(".") for p in rel.split("/"))
        ):
            continue  # checkpoint temp dirs (.0003-*) and write_atomic's .*.tmp files are not the run yet
        step = store.step_of(rel)
        if step is not None and step not in steps:
            continue
        files[rel] = path
    return files


def _remote_objects(client: Any, bucket: str, prefix: str) -> dict[str, dict[str, Any]]:
    """Objects under `prefix`, by path relative to it: {"size", "etag"}."""
    objects = {}
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(prefix) :]
                if rel and not rel.endswith("/"):
                    objects[rel] = {"size": obj["Size"], "etag": obj["ETag"].strip('"')}
    except Exception as error:  # botocore's ClientError / EndpointConnectionError / NoCredentialsError
        raise _s3_error(error, bucket, prefix, "list") from error
    return objects


def _complete_steps(store: RunStore, objects: dict[str, dict[str, Any]]) -> tuple[list[int], list[int]]:
    """(complete, partial) steps in a listing: complete ones have both adapter files."""
    by_step: dict[int, set[str]] = {}
    for rel in objects:
        step = store.step_of(rel)
        if step is not None:
            by_step.setdefault(step, set()).add(rel.split("/", 2)[2])
    complete = sorted(s for s, names in by_step.items() if set(ADAPTER_FILES) <= names)
    return complete, sorted(set(by_step) - set(complete))


def _md5(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def _same(path: Path, remote: dict[str, Any] | None, immutable: bool) -> bool:
    """Whether the object already holds this file. Committed checkpoint files never change, so their size is
    enough; other files compare their MD5 with the ETag (an ETag with '-' is a multipart upload's: no MD5)."""
    if remote is None or remote["size"] != path.stat().st_size:
        return False
    if immutable:
        return True
    return "-" not in remote["etag"] and remote["etag"] == _md5(path)


def _s3_error(error: Exception, bucket: str, key: str, what: str) -> S3SyncError:
    reason = getattr(error, "response", {}).get("Error", {}) if hasattr(error, "response") else {}
    code = reason.get("Code")
    if code in ("NoSuchBucket", "404") and what == "list":
        return S3SyncError(f"the bucket {bucket!r} does not exist (or is not visible with these credentials)")
    detail = f"{code}: {reason.get('Message', '')}" if code else f"{type(error).__name__}: {error}"
    return S3SyncError(f"S3 {what} of s3://{bucket}/{key} failed ({detail})")


# push ---------------------------------------------------------------------------------------------------
def push(
    store: RunStore,
    bucket: str,
    prefix: str | None = None,
    *,
    delete: bool = False,
    verbose: bool = False,
    client: Any = None,
    stop: threading.Event | None = None,
) -> SyncReport:
    """Upload the run's committed steps and files to the bucket; each step's weights last (see module doc).

    `stop`: set from another thread to interrupt between files; the unfinished step's new objects are removed.
    """
    if not store.dir.is_dir():
        raise FileNotFoundError(f"no run directory {store.dir} to push: train or pull the model first")
    client = client or s3_client()
    root = s3_prefix(store.project, store.name, prefix)
    local = _local_files(store)
    remote = _remote_objects(client, bucket, root)
    report = SyncReport(steps=store.steps())

    def order(rel: str) -> tuple:
        step = store.step_of(rel)
        if step is None:
            return (1, 0, 0, rel)  # history and trajectories after the checkpoints they describe
        return (0, step, rel.endswith("/" + WEIGHTS), rel)

    todo = [
        rel
        for rel in sorted(local, key=order)
        if not _same(local[rel], remote.get(rel), immutable=store.step_of(rel) is not None)
    ]
    uploaded_in_step: dict[int, list[str]] = {}
    total = sum(local[rel].stat().st_size for rel in todo)
    with tqdm(
        total=total, unit="B", unit_scale=True, desc=f"push {store.project}/{store.name}", disable=not todo
    ) as bar:
        try:
            for rel in todo:
                if stop is not None and stop.is_set():
                    raise InterruptedError("push interrupted")
                _upload(client, local[rel], bucket, root + rel, bar)
                report.uploaded.append(rel)
                step = store.step_of(rel)
                if step is not None and _relative(store, step, WEIGHTS) not in remote:
                    uploaded_in_step.setdefault(step, []).append(rel)
                    if rel.endswith("/" + WEIGHTS):
                        uploaded_in_step.pop(step)  # the step is complete in the bucket
        except BaseException:
            for rels in uploaded_in_step.values():  # an unfinished new step: leave nothing of it behind
                _delete(client, bucket, [root + r for r in rels])
            raise
    if delete:
        gone = [rel for rel in remote if rel not in local]
        # a step's weights go first, so a step being deleted never looks complete with files missing
        gone.sort(key=lambda rel: (not rel.endswith("/" + WEIGHTS), rel))
        _delete(client, bucket, [root + rel for rel in gone])
        report.deleted = gone
    if verbose:
        print(
            f"pushed {store.project}/{store.name} to s3://{bucket}/{root}: {len(report.uploaded)} files uploaded, "
            f"{len(report.deleted)} deleted; steps {report.steps}"
        )
    return report


def _upload(client: Any, path: Path, bucket: str, key: str, bar: tqdm) -> None:
    try:
        client.upload_file(str(path), bucket, key, Callback=bar.update)
    except Exception as error:
        raise _s3_error(error, bucket, key, "upload") from error


def _delete(client: Any, bucket: str, keys: list[str]) -> None:
    for key in keys:  # one by one, in order (delete_objects gives no order)
        try:
            client.delete_object(Bucket=bucket, Key=key)
        except Exception as error:
            raise _s3_error(error, bucket, key, "delete") from error


# pull ---------------------------------------------------------------------------------------------------
def one_step(
    step: int | Literal["latest"] | None, only_step: int | Literal["latest"] | None, latest_only: bool
) -> int | Literal["latest"] | None:
    """The one step a pull asks for, however ART spelled it (`step`, then `only_step`, `latest_only`), or None
    for all; a ValueError when two spellings disagree."""
    spellings = {"only_step": only_step, "step": step, "latest_only": "latest" if latest_only else None}
    asked = {name: value for name, value in spellings.items() if value is not None}
    if len(set(asked.values())) > 1:
        said = ", ".join(f"{name}={value!r}" for name, value in asked.items())
        raise ValueError(
            f"_experimental_pull_from_s3({said}): these ask for different steps; pass one of them"
        )
    if only_step is not None and only_step != "latest" and not isinstance(only_step, int):
        raise ValueError(f"only_step={only_step!r}: a step number or 'latest'")
    return next(iter(asked.values()), None)


def check_exclude(exclude: Iterable[str] | None) -> frozenset[str]:
    """ART's `exclude` (a list of "checkpoints", "logs", "trajectories") as a set; a ValueError for other names."""
    if exclude is None:
        return frozenset()
    if isinstance(exclude, str):
        raise TypeError(f"exclude={exclude!r}: pass a list, e.g. exclude=['logs', 'trajectories']")
    names = frozenset(exclude)
    if unknown := sorted(names - set(EXCLUDABLE)):
        raise ValueError(
            f"exclude={sorted(names)}: {unknown} cannot be excluded; the options are {EXCLUDABLE}"
        )
    return names


def latest_remote_step(store: RunStore, bucket: str, prefix: str | None = None) -> int | None:
    """The newest complete step of `store`'s run in the bucket, or None when it has none."""
    remote = _remote_objects(s3_client(), bucket, s3_prefix(store.project, store.name, prefix))
    complete, _ = _complete_steps(store, remote)
    return complete[-1] if complete else None


def pull(
    store: RunStore,
    bucket: str,
    prefix: str | None = None,
    *,
    step: int | Literal["latest"] | None = None,
    not_after_step: int | None = None,
    delete: bool = False,
    verbose: bool = False,
    exclude: Iterable[str] | None = None,
    client: Any = None,
) -> SyncReport:
    """Download the bucket's complete steps (or only `step`, "latest" for the newest, or the newest not after
    `not_after_step`) and the run's other files into `store`, leaving out the top-level folders in `exclude`
    (see EXCLUDABLE; an excluded folder is not deleted by `delete=True` either, as with `aws s3 sync`). The
    caller must be the run's writer (hold its lock)."""
    excluded = check_exclude(exclude)
    if "checkpoints" in excluded and (step is not None or not_after_step is not None):
        raise ValueError(
            "exclude=['checkpoints'] leaves out the checkpoint this pull asks for; drop one of the two"
        )
    client = client or s3_client()
    root = s3_prefix(store.project, store.name, prefix)
    remote = {
        rel: obj for rel, obj in _remote_objects(client, bucket, root).items() if not _in(rel, excluded)
    }
    complete, partial = _complete_steps(store, remote)
    report = SyncReport(ignored_partial_steps=partial)
    if step == "latest":
        if not complete:
            raise FileNotFoundError(
                f"no complete step of {store.project}/{store.name} in s3://{bucket}/{root}: nothing to pull"
            )
        step = complete[-1]
    wanted = complete
    if step is not None or not_after_step is not None:
        if step is not None and step not in complete:
            raise FileNotFoundError(
                f"step {step} of {store.project}/{store.name} is not in s3://{bucket}/{root}; complete steps "
                f"there: {complete}"
            )
        limit = [s for s in complete if not_after_step is None or s <= not_after_step]
        wanted = [step] if step is not None else limit[-1:]
    files = [rel for rel in remote if store.step_of(rel) is None]
    if step is not None or not_after_step is not None:
        files = []  # one checkpoint only, as ART's pull of a step
    local_steps = store.steps()
    ahead = [] if "checkpoints" in excluded else [s for s in local_steps if s not in complete]
    todo_steps = []
    for s in wanted:
        if s not in local_steps:
            todo_steps.append(s)
        elif not _same_step(store, s, remote, root):
            if not delete:
                raise ValueError(
                    f"checkpoint {s} of {store.project}/{store.name} in {store.dir} differs from the one in "
                    f"s3://{bucket}/{root} (two runs under one name?). Nothing was pulled. Pull into another "
                    "path or name, or pass delete=True to replace the local run with the bucket's"
                )
            todo_steps.append(s)
    with tqdm(
        total=len(todo_steps) + len(files),
        unit="file",
        desc=f"pull {store.project}/{store.name}",
        disable=not (todo_steps or files),
    ) as bar:
        for s in todo_steps:
            names = sorted(r for r in remote if store.step_of(r) == s)
            _pull_step(client, bucket, root, store, s, names)
            report.downloaded.extend(names)
            bar.update()
        for rel in files:
            _pull_file(client, bucket, root, store, rel, remote[rel], delete, ahead, report)
            bar.update()
    if delete and step is None and not_after_step is None:
        for s in [] if "checkpoints" in excluded else ahead:
            store.delete_checkpoint(s)
            report.deleted.append(_relative(store, s))
        for rel, path in _local_files(store).items():
            if store.step_of(rel) is None and rel not in remote and not _in(rel, excluded | {"logs"}):
                path.unlink()
                report.deleted.append(rel)
    store.recover()  # a pulled step whose rollouts were not yet published when it was pushed
    report.steps = store.steps()
    if verbose:
        print(
            f"pulled {store.project}/{store.name} from s3://{bucket}/{root}: steps {report.steps}"
            + (f" (ignored steps without their weights: {partial})" if partial else "")
        )
    return report


def _in(rel: str, folders: Iterable[str]) -> bool:
    """Whether the run-relative path `rel` lies in one of the top-level `folders`."""
    return rel.split("/", 1)[0] in folders


def _same_step(store: RunStore, step: int, remote: dict[str, dict[str, Any]], root: str) -> bool:
    """Whether the local checkpoint is the bucket's: its adapter files and commit record (whose id is unique to
    the commit) match by MD5, or by size for objects uploaded in parts."""
    local = store.checkpoint_path(step)
    return all(
        (local / n).is_file() and _same(local / n, remote[_relative(store, step, n)], immutable=False)
        for n in (*ADAPTER_FILES, "commit.json")
        if _relative(store, step, n) in remote
    )


def _pull_step(client: Any, bucket: str, root: str, store: RunStore, step: int, names: list[str]) -> None:
    """Download one step into a temp directory, then rename it into place (replacing a differing one)."""
    store.checkpoints.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=store.checkpoints, prefix=f".{step:04d}-pull-"))
    try:
        for rel in names:
            target = tmp / rel.split("/", 2)[2]
            target.parent.mkdir(parents=True, exist_ok=True)
            _download(client, bucket, root + rel, target)
        final = store.checkpoint_path(step)
        if final.exists():
            shutil.rmtree(final)
        publish_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _pull_file(
    client: Any,
    bucket: str,
    root: str,
    store: RunStore,
    rel: str,
    remote: dict[str, Any],
    delete: bool,
    ahead: list[int],
    report: SyncReport,
) -> None:
    """Bring one non-checkpoint file up to the bucket's copy; a local history that extends the bucket's is newer
    and kept. A file that differs otherwise is replaced, unless the local run has steps the bucket lacks."""
    local = store.dir / rel
    if local.is_file() and _same(local, remote, immutable=False):
        return
    store.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(
        dir=store.dir, prefix=".pull-"
    ) as tmp:  # dot: never pushed, never a step
        fetched = Path(tmp) / "object"
        _download(client, bucket, root + rel, fetched)
        data = fetched.read_bytes()
    if local.is_file() and not delete:
        mine = local.read_bytes()
        if mine.startswith(data):
            return  # the local run went on after the push: its file is the newer one
        if ahead:
            raise ValueError(
                f"{rel} of {store.project}/{store.name} differs from the bucket's, and the local run has steps "
                f"the bucket lacks ({ahead}). Push first, or pass delete=True to replace the local run with the "
                "bucket's"
            )
    write_atomic(local, data)
    report.downloaded.append(rel)


def _download(client: Any, bucket: str, key: str, target: Path) -> None:
    try:
        client.download_file(bucket, key, str(target))
    except Exception as error:
        raise _s3_error(error, bucket, key, "download") from error
