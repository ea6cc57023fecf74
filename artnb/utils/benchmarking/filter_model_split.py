"""Keep the rows of the requested (model, split) pairs and give each model its display name.

The charts' shared first step, as in OpenPipe ART's `art.utils.benchmarking.filter_model_split`, on pandas.
"""

from __future__ import annotations

import pandas as pd

from .types import BenchmarkModelKey


def filter_rename_model_split(df: pd.DataFrame, models: list[BenchmarkModelKey]) -> pd.DataFrame:
    """Rows whose (model, split) is one of `models`, with `model` replaced by that key's display name."""
    missing = [c for c in ("model", "split") if c not in df.columns]
    if missing:
        raise KeyError(
            f"the table has no {missing} column; pass the DataFrame that load_trajectories returned "
            f"(it has {list(df.columns)})"
        )
    parts = []
    for key in models:
        rows = df[(df["model"] == key.name) & (df["split"] == key.split)]
        parts.append(rows.assign(model=key.display_name))
    return pd.concat(parts, ignore_index=True) if parts else df.iloc[0:0]
