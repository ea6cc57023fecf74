"""On-disk cache of LLM-judge answers, so re-running a notebook cell that scores the same groups costs nothing.

One JSON file per answer, named by the SHA-256 of everything that decides it (judge, its settings, the exact
prompt and the answer schema), written atomically so a killed kernel never leaves a half-written entry.
Unreadable entries count as misses. The location is `cache_dir`, else `$ARTNB_CACHE_DIR/<name>`, else
`$XDG_CACHE_HOME/artnb/<name>` (`~/.cache/artnb/<name>`); delete the folder to forget every answer.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

CACHE_ENV = "ARTNB_CACHE_DIR"


def default_cache_dir(name: str) -> Path:
    """Where artnb keeps cache `name` unless told otherwise."""
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root).expanduser() / name
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "artnb" / name


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
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"value": value}, f, ensure_ascii=False)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
