"""The run directory on disk: checkpoints, metric history, logged trajectories and user state.

Layout under `{path}/{project}/models/{name}/`:
    checkpoints/{step:04d}/        LoRA adapter (+ optimizer.pt), written to a temp dir and renamed into place
    history.jsonl                  one row per logged split and step: {"step", "split", "recorded_at", "{split}/metric"}
    trajectories/{split}/{step:04d}.parquet
    state.json                     the user's own state (e.g. position in a dataset)
    logs/                          engine logs
The step is the newest *complete* checkpoint, so a process killed mid-write resumes from the last good one.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from .trajectory import Trajectory, TrajectoryGroup

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class RunStore:
    """Reads and writes one model's run directory. Cheap to create; every method goes to disk."""

    def __init__(self, path: str | Path, project: str, name: str) -> None:
        self.dir = Path(path).expanduser().resolve() / project / "models" / name
        self.checkpoints = self.dir / "checkpoints"
        self.logs = self.dir / "logs"

    # checkpoints ---------------------------------------------------------------------------------
    def checkpoint_path(self, step: int) -> Path:
        return self.checkpoints / f"{step:04d}"

    def steps(self) -> list[int]:
        """Steps with a complete checkpoint, ascending."""
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
        """Call `write(tmp_dir)` then rename tmp_dir to checkpoints/{step:04d}; a crash leaves no partial step."""
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        final = self.checkpoint_path(step)
        tmp = Path(tempfile.mkdtemp(dir=self.checkpoints, prefix=f".{step:04d}-"))
        try:
            write(tmp)
            missing = [f for f in ADAPTER_FILES if not (tmp / f).is_file()]
            if missing:
                raise RuntimeError(f"checkpoint writer did not produce {missing}")
            if final.exists():  # an incomplete leftover from a killed run
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final

    def copy_checkpoint(self, src_step: int, dst_step: int) -> Path:
        src = self.checkpoint_path(src_step)
        return self.write_checkpoint(dst_step, lambda tmp: shutil.copytree(src, tmp, dirs_exist_ok=True))

    def delete_checkpoint(self, step: int) -> None:
        shutil.rmtree(self.checkpoint_path(step), ignore_errors=True)

    def clean_partial_checkpoints(self) -> None:
        """Remove temp dirs left by a process killed while writing a checkpoint."""
        if self.checkpoints.is_dir():
            for p in self.checkpoints.iterdir():
                if p.name.startswith("."):
                    shutil.rmtree(p, ignore_errors=True)

    # history ---------------------------------------------------------------------------------------
    @property
    def history_path(self) -> Path:
        return self.dir / "history.jsonl"

    def append_history(self, row: dict[str, Any]) -> None:
        clean = {k: v for k, v in row.items() if not (isinstance(v, float) and not math.isfinite(v))}
        clean.setdefault("recorded_at", time.time())
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.history_path, "a") as f:
            f.write(json.dumps(clean, default=str) + "\n")

    def history(self) -> pd.DataFrame:
        """All history rows as a DataFrame (empty if nothing was logged)."""
        if not self.history_path.exists():
            return pd.DataFrame(columns=["step", "split"])
        rows = [json.loads(line) for line in self.history_path.read_text().splitlines() if line.strip()]
        return pd.DataFrame(rows) if rows else pd.DataFrame(columns=["step", "split"])

    # trajectories ----------------------------------------------------------------------------------
    def trajectories_path(self, split: str, step: int) -> Path:
        return self.dir / "trajectories" / split / f"{step:04d}.parquet"

    def write_trajectories(self, split: str, step: int, groups: Iterable[TrajectoryGroup]) -> Path:
        """Append the groups to trajectories/{split}/{step:04d}.parquet (atomically replaced)."""
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
                        "group_metadata": json.dumps(group.metadata, default=str),
                        "group_exceptions": json.dumps([e.model_dump() for e in group.exceptions]),
                    }
                )
        path = self.trajectories_path(split, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        df = pd.DataFrame(rows)
        if path.exists():
            old = pd.read_parquet(path)
            if len(old):
                df["group_index"] += int(old["group_index"].max()) + 1
            df = pd.concat([old, df], ignore_index=True)
        tmp = path.with_name(f".{path.name}.tmp")
        df.to_parquet(tmp, index=False)
        os.replace(tmp, path)
        return path

    def read_trajectories(self, split: str, step: int) -> list[TrajectoryGroup]:
        """Groups logged for a split and step, rebuilt as TrajectoryGroups of plain message dicts."""
        df = pd.read_parquet(self.trajectories_path(split, step))
        groups = []
        for _, rows in df.groupby("group_index", sort=True):
            trajs = []
            for r in rows.itertuples():
                messages = json.loads(r.messages)
                trajs.append(
                    Trajectory(
                        messages_and_choices=messages,
                        reward=r.reward,
                        metrics=json.loads(r.metrics),
                        metadata=json.loads(r.metadata),
                        logs=list(r.logs),
                        tools=json.loads(r.tools),
                    )
                )
            groups.append(TrajectoryGroup(trajs, metadata=json.loads(rows.iloc[0]["group_metadata"])))
        return groups

    # user state ------------------------------------------------------------------------------------
    @property
    def state_path(self) -> Path:
        return self.dir / "state.json"

    def read_state(self) -> dict[str, Any]:
        return json.loads(self.state_path.read_text()) if self.state_path.exists() else {}

    def write_state(self, state: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_name(".state.json.tmp")
        tmp.write_text(json.dumps(state, indent=1, default=str))
        os.replace(tmp, self.state_path)
