"""The run directory: the one place that knows its layout, how each file in it is written, and who may write.

Layout under `{path}/{project}/models/{name}/` (`name` is the model's `storage_name`: its run_name, else its name):
    model.json                       the model's settings at its last register (never its API key) and its
                                     chat rendering (template sha256, template kwargs), checked on resume
    .lock                            held (an OS file lock) by the one process that trains the run; names it
    checkpoints/{step:04d}/          a committed step: LoRA adapter, optimizer.pt, commit.json
    checkpoints/{step:04d}/rollouts.parquet   present until that step's rollouts and history row are published
    checkpoints/.{step:04d}-*/       a step being written; still there on open means it was never committed
    history.jsonl                    one row per logged split and step: {"step", "split", "recorded_at", ...}
    trajectories/{split}/{step:04d}.parquet
    state.json                       the user's own state (e.g. position in a dataset)
    logs/                            engine logs
    wandb/                           W&B's files for the model's run, when W&B reporting is on

Why a training step is a transaction: a step makes three things (the new checkpoint, the history row that
says what happened, the rollouts it trained on) and a crash between any two of them used to leave a step with
no history, or rollouts counted twice. So `commit_step` writes all three into the checkpoint's temp directory
and renames it into place: that rename is the commit. Only then are the rollouts and the row published to
`trajectories/train/` and `history.jsonl`; a crash during publication is finished by `recover()` on the next
open (roll forward), and a step whose rename never happened leaves only a temp directory, removed there (roll
back). The step is the newest committed checkpoint, so `range(await model.get_step(), N)` resumes exactly.

Every file is written through `atomic.py` (temp file, fsync, rename, fsync the directory).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import os
import shutil
import socket
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from .atomic import append_line, disk_full, publish_dir, write_atomic
from .names import check_name, check_split, check_step
from .trajectory import History, Trajectory, TrajectoryGroup

log = logging.getLogger("artnb")

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
COMMIT_FILE = "commit.json"
PENDING_ROLLOUTS = "rollouts.parquet"  # in a checkpoint until its rollouts and history row are published


class RunInUseError(RuntimeError):
    """Another process (or another backend in this one) is training this run directory."""


@dataclass(frozen=True)
class Commit:
    """What a committed training step recorded: its history row and the checkpoint it made."""

    id: str
    step: int  # the step whose policy produced the rollouts (the history row's step)
    checkpoint: int  # the new checkpoint, step + 1 (or step for a checkpoint copied forward)
    history: dict[str, Any]


class RunStore:
    """Reads and writes one model's run directory. Cheap to create; every method goes to disk.

    Anyone may read (history, trajectories, checkpoints); `lock()` makes this process the run's one writer.
    """

    def __init__(self, path: str | Path, project: str, name: str) -> None:
        check_name(project, "project")
        check_name(name, "name")
        self.root = Path(path).expanduser().resolve()
        self.project, self.name = project, name
        self.dir = self.root / project / "models" / name
        self.checkpoints = self.dir / "checkpoints"
        self.logs = self.dir / "logs"

    def step_of(self, relative: str) -> int | None:
        """The step a path relative to the run directory belongs to ('checkpoints/0003/x' -> 3; S3 keys mirror
        this layout); None for files outside the checkpoints."""
        parts = relative.split("/")
        if len(parts) >= 3 and parts[0] == self.checkpoints.name and parts[1].isdigit():
            return int(parts[1])
        return None

    @classmethod
    def from_dir(cls, run_dir: str | Path) -> RunStore:
        """The store of an existing run directory `{path}/{project}/models/{name}`."""
        d = Path(run_dir).expanduser().resolve()
        if d.parent.name != "models":
            raise ValueError(
                f"{d} is not a model's run directory; pass the folder that holds history.jsonl, "
                "i.e. {path}/{project}/models/{name}"
            )
        return cls(d.parent.parent.parent, d.parent.parent.name, d.name)

    def __repr__(self) -> str:
        return f"RunStore({str(self.dir)!r})"

    @property
    def wandb_dir(self) -> Path:
        """Where W&B keeps this run's files (wandb.init's `dir`; W&B adds its own `wandb/` inside)."""
        return self.dir

    # the writer lock -------------------------------------------------------------------------------
    @property
    def lock_path(self) -> Path:
        return self.dir / ".lock"

    def lock(self) -> RunLock:
        """Become the run's one writer until `release()` (or this process ends); RunInUseError if taken."""
        self.dir.mkdir(parents=True, exist_ok=True)
        return RunLock(self.lock_path)

    def holder(self) -> dict[str, Any] | None:
        """Who holds (or last held) the writer lock: pid, host, since; None if never locked."""
        try:
            return json.loads(self.lock_path.read_text() or "null")
        except (OSError, ValueError):
            return None

    # model settings --------------------------------------------------------------------------------
    def write_model_info(self, info: dict[str, Any]) -> None:
        write_atomic(self.model_info_path, json.dumps(info, indent=1, default=str))

    @property
    def model_info_path(self) -> Path:
        return self.dir / "model.json"

    def read_model_info(self) -> dict[str, Any] | None:
        """The settings of the model's last successful register (None: none recorded, or unreadable)."""
        try:
            info = json.loads(self.model_info_path.read_text())
        except (OSError, ValueError):
            return None
        return info if isinstance(info, dict) else None

    # checkpoints -----------------------------------------------------------------------------------
    def checkpoint_path(self, step: int) -> Path:
        return self.checkpoints / f"{step:04d}"

    def steps(self) -> list[int]:
        """Steps with a committed checkpoint, ascending."""
        if not self.checkpoints.is_dir():
            return []
        out = []
        for p in self.checkpoints.iterdir():
            if p.name.isdigit() and all((p / f).is_file() for f in ADAPTER_FILES):
                out.append(int(p.name))
        return sorted(out)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def write_checkpoint(self, step: int, write: Callable[[Path], None]) -> Path:
        """Call `write(tmp_dir)`, then move tmp_dir to checkpoints/{step:04d} in one durable rename.

        A crash leaves a temp directory (removed by `recover`), never a partial step. An existing step is never
        replaced: FileExistsError, since another writer must have made it.
        """
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        final = self.checkpoint_path(step)
        if final.exists() and all((final / f).is_file() for f in ADAPTER_FILES):
            raise FileExistsError(
                f"checkpoint {final} already exists; a run directory has one writer (see RunStore.lock)"
            )
        tmp = Path(tempfile.mkdtemp(dir=self.checkpoints, prefix=f".{step:04d}-"))
        try:
            write(tmp)
            missing = [f for f in ADAPTER_FILES if not (tmp / f).is_file()]
            if missing:
                raise RuntimeError(f"checkpoint writer did not produce {missing}")
            if final.exists():  # an incomplete directory from an older artnb that wrote in place
                shutil.rmtree(final)
            log.debug("checkpoint %s written; renaming", final, extra={"artnb_phase": "rename"})
            publish_dir(tmp, final)
        except BaseException as error:
            full = isinstance(error, Exception) and disk_full(
                error, tmp
            )  # measured before the cleanup frees space
            shutil.rmtree(tmp, ignore_errors=True)
            if full and not (isinstance(error, OSError) and error.errno == errno.ENOSPC):
                raise OSError(
                    errno.ENOSPC, f"no space left on device for checkpoint {final.name}: {error}"
                ) from error
            raise
        return final

    def commit_step(
        self,
        step: int,
        write: Callable[[Path], None] | None,
        history_row: dict[str, Any],
        groups: Iterable[TrajectoryGroup],
    ) -> Commit:
        """Commit a training step: checkpoint step+1 (written by `write`, or a copy of checkpoint `step` when
        `write` is None), with the history row and the rollouts inside it, in one rename. `publish` then writes
        the row and rollouts where readers look; until it has, `publish_pending` (or `recover`) will.
        """
        commit = Commit(uuid.uuid4().hex, step, step + 1, _clean_row({**history_row, "step": step}))
        rollouts = _rollout_frame(groups)
        source = self.checkpoint_path(step)

        def write_all(tmp: Path) -> None:
            if write is None:
                copy_checkpoint_files(source, tmp)
            else:
                write(tmp)
            rollouts.to_parquet(tmp / PENDING_ROLLOUTS, index=False)
            record = {"commit": commit.id, "step": step, "history": {**commit.history, "commit": commit.id}}
            (tmp / COMMIT_FILE).write_text(json.dumps(record, default=str))

        self.write_checkpoint(step + 1, write_all)
        return commit

    def read_commit(self, checkpoint: int) -> Commit | None:
        """The commit record of a checkpoint (None for checkpoint 0 and for checkpoints older artnb wrote)."""
        try:
            record = json.loads((self.checkpoint_path(checkpoint) / COMMIT_FILE).read_text())
        except (OSError, ValueError):
            return None
        return Commit(record["commit"], int(record["step"]), checkpoint, record["history"])

    def publish(self, checkpoint: int) -> bool:
        """Write a committed step's rollouts and history row where readers look, once. True if it did anything."""
        pending = self.checkpoint_path(checkpoint) / PENDING_ROLLOUTS
        commit = self.read_commit(checkpoint)
        if commit is None or not pending.is_file():
            return False
        write_atomic(self.trajectories_path("train", commit.step), pending.read_bytes())
        if not self._history_has_commit(commit.id):
            append_line(self.history_path, json.dumps(commit.history, default=str))
        pending.unlink()
        return True

    def _history_has_commit(self, commit_id: str) -> bool:
        if not self.history_path.exists():
            return False
        return any(row.get("commit") == commit_id for row in self._history_rows(warn=False))

    def recover(self) -> list[str]:
        """Finish or undo what a process killed mid-step left, as the writer (under `lock()`).

        Removes checkpoint temp directories (steps never committed) and publishes committed steps whose
        rollouts or history row are missing. Returns one sentence per thing done (empty when all was well).
        """
        done = []
        if self.checkpoints.is_dir():
            for p in sorted(self.checkpoints.iterdir()):
                if p.name.startswith("."):
                    shutil.rmtree(p, ignore_errors=True)
                    step = p.name[1:5]
                    done.append(
                        f"removed checkpoint {step}, which was being written when its process stopped "
                        "(that step was never committed, so it is trained again)"
                    )
        for p in self.dir.rglob(".*.tmp") if self.dir.is_dir() else []:
            p.unlink(missing_ok=True)  # a file write_atomic never renamed: the old file is intact
        for checkpoint in self.publish_pending():
            step = checkpoint - 1
            done.append(
                f"published step {step}'s history row and rollouts from checkpoint {checkpoint}, which was "
                "committed just before its process stopped"
            )
        return done

    def publish_pending(self) -> list[int]:
        """Publish every committed step whose rollouts and history row are not published yet; their checkpoints."""
        if not self.checkpoints.is_dir():
            return []
        pending = sorted(int(p.parent.name) for p in self.checkpoints.glob(f"[0-9]*/{PENDING_ROLLOUTS}"))
        return [c for c in pending if self.publish(c)]

    def delete_checkpoint(self, step: int) -> None:
        shutil.rmtree(self.checkpoint_path(step), ignore_errors=True)

    # history ---------------------------------------------------------------------------------------
    @property
    def history_path(self) -> Path:
        return self.dir / "history.jsonl"

    def append_history(self, row: dict[str, Any]) -> None:
        """Append one row (non-finite numbers are left out: JSON has no NaN)."""
        append_line(self.history_path, json.dumps(_clean_row(row), default=str))

    def history(self) -> pd.DataFrame:
        """All history rows as a DataFrame (empty if nothing was logged). Damaged lines are skipped with a warning.

        Rows that share a commit id (metrics `model.log` added to a trained step later) form one row.
        """
        rows: list[dict[str, Any]] = []
        by_commit: dict[str, dict[str, Any]] = {}
        for row in self._history_rows(warn=True):
            commit = row.get("commit")
            if commit is None or commit not in by_commit:
                rows.append(row)
                if commit is not None:
                    by_commit[commit] = row
            else:
                by_commit[commit].update({k: v for k, v in row.items() if k not in by_commit[commit]})
        return pd.DataFrame(rows) if rows else pd.DataFrame(columns=["step", "split"])

    def _history_rows(self, warn: bool) -> list[dict[str, Any]]:
        if not self.history_path.exists():
            return []
        rows = []
        text = self.history_path.read_bytes().decode("utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict) or "step" not in row or "split" not in row:
                    raise ValueError("not a history row")
            except ValueError:
                if warn:
                    warnings.warn(
                        f"artnb: {self.history_path} line {number} is damaged (a write cut short by a crash?) "
                        f"and was skipped: {line[:80]!r}. The other rows are intact.",
                        stacklevel=3,
                    )
                continue
            rows.append(row)
        return rows

    # trajectories ----------------------------------------------------------------------------------
    def trajectories_dir(self, split: str) -> Path:
        return self.dir / "trajectories" / _one_folder(split)

    def trajectories_path(self, split: str, step: int) -> Path:
        return self.trajectories_dir(split) / f"{check_step(step):04d}.parquet"

    def trajectory_files(self) -> list[tuple[str, int]]:
        """(split, step) of every logged trajectories file, sorted."""
        root = self.dir / "trajectories"
        if not root.is_dir():
            return []
        return sorted(
            (d.name, int(p.stem))
            for d in root.iterdir()
            if d.is_dir()
            for p in d.glob("[0-9]*.parquet")
            if p.stem.isdigit()
        )

    def write_trajectories(self, split: str, step: int, groups: Iterable[TrajectoryGroup]) -> Path:
        """Add the groups to trajectories/{split}/{step:04d}.parquet (the file is replaced atomically)."""
        df = _rollout_frame(groups)
        path = self.trajectories_path(split, step)
        if path.exists():
            old = pd.read_parquet(path)
            if len(old):
                df["group_index"] += int(old["group_index"].max()) + 1
            df = pd.concat([old, df], ignore_index=True)
        return write_atomic(path, _parquet_bytes(df))

    def read_trajectories(self, split: str, step: int) -> list[TrajectoryGroup]:
        """Groups logged for a split and step, rebuilt as TrajectoryGroups of plain message dicts."""
        return read_rollouts(self.trajectories_path(split, step))

    # user state ------------------------------------------------------------------------------------
    @property
    def state_path(self) -> Path:
        return self.dir / "state.json"

    def read_state(self) -> dict[str, Any]:
        return json.loads(self.state_path.read_text()) if self.state_path.exists() else {}

    def write_state(self, state: dict[str, Any]) -> None:
        write_atomic(self.state_path, json.dumps(state, indent=1, default=str))


def _one_folder(split: Any) -> str:
    """`split` if it names one folder inside trajectories/; else check_split's error. A second line of defence
    (model.log checks the full name rule first): only what would leave the folder or fail deep in a write is
    refused here, so readers listing folders that already exist (e.g. `.ipynb_checkpoints`) keep working."""
    if isinstance(split, str) and split not in ("", ".", "..") and not {"/", "\\", "\0"} & set(split):
        return split
    return check_split(split)  # refuses every such value, with the rule


def copy_checkpoint_files(src: Path, dst: Path) -> None:
    """A checkpoint's adapter and optimizer state, without its commit record and pending rollouts."""
    for f in src.iterdir():
        if f.is_file() and f.name not in (COMMIT_FILE, PENDING_ROLLOUTS):
            shutil.copy2(f, dst / f.name)


class RunLock:
    """An exclusive OS lock (`flock`) on a run's `.lock` file: one writer per run directory.

    The OS drops it when the process ends, however it ends (kill -9 included), so a stale lock cannot block a
    run. The file names the holder (pid, host, since) for the error a second writer gets.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunInUseError(_in_use_message(path)) from None
        self._fd: int | None = fd
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        os.fsync(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _in_use_message(path: Path) -> str:
    try:
        holder = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        holder = {}
    pid, host, since = holder.get("pid"), holder.get("host"), holder.get("since")
    who = f"process {pid} on {host}" if pid else "another process"
    if pid == os.getpid() and host == socket.gethostname():
        who = f"this process ({pid}): another LocalBackend in this kernel"
    return (
        f"the run directory {path.parent} is being trained by {who}"
        + (f" since {since}" if since else "")
        + ". A run has one writer at a time: close that backend (`await backend.close()`) or stop that "
        "kernel, then register again; or give this model another name. Reading it (model.history(), "
        "art.widgets.RewardPlot(run_dir)) works meanwhile."
    )


def _clean_row(row: dict[str, Any]) -> dict[str, Any]:
    clean = {k: v for k, v in row.items() if not (isinstance(v, float) and not math.isfinite(v))}
    clean.setdefault("recorded_at", time.time())
    return clean


def _rollout_frame(groups: Iterable[TrajectoryGroup]) -> pd.DataFrame:
    rows = []
    for gi, group in enumerate(groups):
        for ti, t in enumerate(group.trajectories):
            rec = t.for_logging()
            rows.append(
                {
                    "group_index": gi,
                    "trajectory_index": ti,
                    "reward": float(t.reward),
                    "metrics": json.dumps(rec["metrics"], default=str),
                    "metadata": json.dumps(rec["metadata"], default=str),
                    "logs": rec["logs"],
                    "tools": json.dumps(rec["tools"], default=str),
                    "messages": json.dumps(rec["messages"], default=str, ensure_ascii=False),
                    "additional_histories": json.dumps(
                        rec["additional_histories"], default=str, ensure_ascii=False
                    ),
                    "group_metadata": json.dumps(group.metadata, default=str),
                    "group_exceptions": json.dumps([e.model_dump() for e in group.exceptions]),
                }
            )
    return pd.DataFrame(rows, columns=_ROLLOUT_COLUMNS)


_ROLLOUT_COLUMNS = [
    "group_index", "trajectory_index", "reward", "metrics", "metadata", "logs", "tools", "messages",
    "additional_histories", "group_metadata", "group_exceptions",
]  # fmt: skip


def _parquet_bytes(df: pd.DataFrame) -> bytes:
    return df.to_parquet(index=False)


def read_rollouts(path: str | Path) -> list[TrajectoryGroup]:
    """Groups from a rollouts parquet file (as `write_trajectories` writes them)."""
    df = pd.read_parquet(path)
    # files written before the histories were kept lack them (or, appended to since, hold rows without)
    df["additional_histories"] = df.get("additional_histories", pd.Series(index=df.index, dtype=object))
    df["additional_histories"] = df["additional_histories"].fillna("[]")
    groups = []
    columns = ["messages", "reward", "metrics", "metadata", "logs", "tools", "additional_histories"]
    for _, rows in df.groupby("group_index", sort=True):
        trajs = [
            Trajectory(
                messages_and_choices=json.loads(messages),
                reward=reward,
                metrics=json.loads(metrics),
                metadata=json.loads(metadata),
                logs=list(logs),
                tools=json.loads(tools),
                additional_histories=[
                    History(messages_and_choices=h["messages"], tools=h["tools"])
                    for h in json.loads(histories)
                ],
            )
            for messages, reward, metrics, metadata, logs, tools, histories in rows[columns].itertuples(
                index=False, name=None
            )
        ]
        groups.append(TrajectoryGroup(trajs, metadata=json.loads(rows.iloc[0]["group_metadata"])))
    return groups
