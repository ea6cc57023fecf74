"""`art.serverless.ServerlessBackend`, ART's W&B-hosted training, runs here as a LocalBackend.

W&B Serverless trains on W&B's GPUs and needs a W&B account and network; artnb does not reach it. Rather than
fail on the first cell of ART's notebooks that use it (2048, ART·E, the SFT ones), `ServerlessBackend()` trains
on this machine with a LocalBackend and says so once. Set `base_model` to a model that fits the machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..backends.local import LocalBackend
from ..core.ignored import report_ignored


class ServerlessBackend(LocalBackend):
    """A LocalBackend under ART's ServerlessBackend name (see the module docstring)."""

    def __init__(
        self,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        path: str | Path = "./.art",
        **local_options: Any,
    ) -> None:
        report_ignored(
            "ServerlessBackend",
            "W&B Serverless (hosted training) is not reachable from artnb; training runs on this machine with "
            "a LocalBackend instead, so pick a base_model that fits it",
        )
        super().__init__(path, **local_options)


__all__ = ["ServerlessBackend"]
