"""Every logged trajectory of a project's models as one table, for benchmark charts and ad-hoc analysis.

`df = await load_trajectories("codenames-rl", models=["agent-001", "gpt-4.1-mini"], art_path="./.art")` reads
each model's `trajectories/{split}/{step:04d}.parquet` (written by `model.log(...)` and by training) through
`RunStore` and returns one row per trajectory:

    model, split, step, reward, group_number, messages, logs, metric_<name>..., metadata_<name>...

Same call and columns as OpenPipe ART's `art.utils.benchmarking.load_trajectories`. Departures:
- A pandas DataFrame, not polars (artnb depends on pandas only).
- `art_path=None` means "./.art" (see `artnb.utils.output_dirs`).
- `metadata_<name>` columns merge the group's metadata under the trajectory's own (the trajectory wins), as
  ART's YAML-era loader did; ART's parquet-era loader drops group metadata.
- `messages` are dicts with role, content, trainable, and tool_calls / tool_call_id when present; per-token
  logprobs are left out.
- Nothing found (no project folder, no such model, nothing logged) gives an empty table with the fixed
  columns, and a warning that names the folder searched (ART returns a column-less frame silently).
- No on-disk cache (ART's first version cached results in a SQLite file under the repository).
"""

from __future__ import annotations

import asyncio
import json
import warnings
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

from ...core.store import RunStore
from ..output_dirs import DEFAULT_ART_PATH, get_models_dir

FIXED_COLUMNS = ["model", "split", "step", "reward", "group_number", "messages", "logs"]


async def load_trajectories(
    project_name: str,
    models: list[str] | None = None,
    debug: bool = False,
    art_path: str | Path | None = None,
) -> pd.DataFrame:
    """One row per logged trajectory of `models` (every model in the project if None); pandas, not polars.

    `debug=True` shows progress bars over models and files. The files are read in a worker thread, so the
    notebook's event loop stays free.
    """
    return await asyncio.to_thread(_load, project_name, models, debug, art_path)


def _load(
    project_name: str, models: list[str] | None, debug: bool, art_path: str | Path | None
) -> pd.DataFrame:
    if isinstance(models, str):
        raise TypeError(f"models={models!r}: pass a list of model names, e.g. models=[{models!r}]")
    root = art_path if art_path is not None else DEFAULT_ART_PATH
    models_dir = Path(get_models_dir(project_name, root))
    if models is None:
        names = sorted(p.name for p in models_dir.iterdir() if _is_run_dir(p)) if models_dir.is_dir() else []
    else:
        names = list(models)
    stores = [RunStore(root, project_name, name) for name in names]

    rows: list[dict[str, Any]] = []
    group_numbers: dict[tuple[str, str, int, int], int] = {}
    for store in tqdm(stores, desc="Scanning models", unit="model", disable=not debug):
        for split, step in _logged_files(store):
            frame = pd.read_parquet(store.trajectories_path(split, step))
            for record in frame.to_dict("records"):
                key = (store.name, split, step, int(record.get("group_index", 0)))
                number = group_numbers.setdefault(key, len(group_numbers) + 1)
                rows.append(_row(store.name, split, step, number, record))

    if not rows:
        looked = f"{models_dir}" + (f" for models {names}" if models is not None else "")
        warnings.warn(
            f"load_trajectories found no logged trajectories in {looked}. Check project_name and art_path "
            "(the folder passed to art.LocalBackend(path=...) or art.Model(base_path=...)); trajectories "
            "appear there after `await model.log(groups, split=...)` or a training step.",
            stacklevel=3,
        )
        return pd.DataFrame(columns=FIXED_COLUMNS)

    df = pd.DataFrame(rows)
    df["step"] = df["step"].astype("int64")
    df["group_number"] = df["group_number"].astype("int64")
    df["reward"] = pd.to_numeric(df["reward"], errors="coerce").astype("float64")
    metric_columns = sorted(c for c in df.columns if c.startswith("metric_"))
    for column in metric_columns:
        df[column] = pd.to_numeric(df[column], errors="coerce").astype("float64")
    metadata_columns = sorted(c for c in df.columns if c.startswith("metadata_"))
    return df[FIXED_COLUMNS + metric_columns + metadata_columns]


def _is_run_dir(path: Path) -> bool:
    """A model's folder, not e.g. `.ipynb_checkpoints` or a stray file."""
    try:
        RunStore.from_dir(path)
    except ValueError:
        return False
    return path.is_dir()


def _logged_files(store: RunStore) -> list[tuple[str, int]]:
    """(split, step) of each trajectory file of a run, by split then step."""
    root = store.trajectories_dir("any").parent
    if not root.is_dir():
        return []
    found = []
    for split_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        for path in split_dir.glob("*.parquet"):
            if path.stem.isdigit() and store.trajectories_path(split_dir.name, int(path.stem)) == path:
                found.append((split_dir.name, int(path.stem)))
    return sorted(found)


def _row(model: str, split: str, step: int, group_number: int, record: dict[Hashable, Any]) -> dict[str, Any]:
    metrics = _json(record.get("metrics"), {})
    metadata = {**_json(record.get("group_metadata"), {}), **_json(record.get("metadata"), {})}
    logs = record.get("logs")
    return {
        "model": model,
        "split": split,
        "step": step,
        "reward": record.get("reward"),
        "group_number": group_number,
        "messages": [_message(m) for m in _json(record.get("messages"), [])],
        "logs": list(logs) if logs is not None else [],
        **{f"metric_{k}": v for k, v in metrics.items()},
        **{f"metadata_{k}": _text(v) for k, v in metadata.items()},
    }


def _text(value: Any) -> str:
    """A metadata value as its column's text (as ART's loader: str); nested lists and dicts as JSON, which
    `json.loads` turns back into the value, where Python's repr would not."""
    return json.dumps(value, ensure_ascii=False) if isinstance(value, (dict, list)) else str(value)


def _message(message: dict[str, Any]) -> dict[str, Any]:
    out = {
        "role": message.get("role"),
        "content": message.get("content"),
        "trainable": bool(message.get("trainable", False)),
    }
    for key in ("tool_calls", "tool_call_id"):
        if message.get(key):
            out[key] = message[key]
    return out


def _json(text: Any, default: Any) -> Any:
    if not isinstance(text, str) or not text:
        return default
    try:
        value = json.loads(text)
    except ValueError:
        return default
    return value if isinstance(value, type(default)) else default
