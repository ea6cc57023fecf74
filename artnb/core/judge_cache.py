"""On-disk cache of LLM-judge answers, so re-running a notebook cell that scores the same groups costs nothing.

One JSON file per answer, named by the SHA-256 of everything that decides it (judge, its settings, the exact
prompt and the answer schema), written atomically so a killed kernel never leaves a half-written entry.
Unreadable entries count as misses. The location is `cache_dir`, else the "ruler" folder of artnb's cache
(cache.py: `$ARTNB_CACHE_DIR/ruler` or `~/.cache/artnb/ruler`); delete the folder to forget every answer.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from .atomic import write_atomic


class JudgeCache:
    """`get(key)` / `put(key, value)` for JSON values, where `key(payload)` hashes a JSON-able payload."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser()

    @staticmethod
    def key(payload: Any) -> str:
        canonical = json.dumps(
            payload, sort_keys=True, ensure_ascii=False, default=str, separators=(",", ":")
        )
        return hashlib.sha256(canonical.encode()).hexdigest()

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.json"

    def get(self, key: str) -> Any | None:
        try:
            return json.loads(self.path(key).read_text())["value"]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put(self, key: str, value: Any) -> None:
        write_atomic(self.path(key), json.dumps({"value": value}, ensure_ascii=False))
