"""Where artnb keeps what it can make again (converted models, judge answers): one setting for all of it.

`$ARTNB_CACHE_DIR/<name>`, else `$XDG_CACHE_HOME/artnb/<name>` (`~/.cache/artnb/<name>`). Deleting the folder
loses nothing that is not recomputed on the next use. Run directories (checkpoints, history) are not a cache:
they live under the backend's `path`.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "ARTNB_CACHE_DIR"


def cache_dir(name: str) -> Path:
    """The folder of cache `name` (e.g. "models", "ruler"); not created here."""
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root).expanduser() / name
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "artnb" / name
