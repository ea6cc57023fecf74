"""One-line status messages for notebook cells: `info`, `ok`, `step`, `warn`, `err`.

ART's MCP notebook does `from art.utils.logging import info, ok, step, warn, err` to narrate scenario
generation; these give the same five calls. Each prints one line to stdout with a marker (`[i]`, `[ok]`,
`==>`, `[!]`, `[x]`), in colour where colour renders (a Jupyter kernel or a terminal) and plain elsewhere
(log files, `NO_COLOR` set). They print, like ART's; use the `logging` module for records you want to filter.
"""

from __future__ import annotations

import os
import sys

_RESET = "\033[0m"


def _emit(marker: str, colour: str, message: object) -> None:
    out = sys.stdout
    if _colour_renders(out):
        print(f"\033[{colour}m{marker}{_RESET} {message}", file=out, flush=True)
    else:
        print(f"{marker} {message}", file=out, flush=True)


def _colour_renders(stream: object) -> bool:
    if os.environ.get("NO_COLOR"):
        return False
    if "ipykernel" in sys.modules:  # notebook output renders ANSI colours though it is not a tty
        return True
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def info(message: object) -> None:
    """A neutral fact: `info(f"{len(scenarios)} scenarios")`."""
    _emit("[i]", "36", message)


def ok(message: object) -> None:
    """Something finished as hoped."""
    _emit("[ok]", "32", message)


def step(message: object) -> None:
    """The start of a phase of work."""
    _emit("==>", "1;34", message)


def warn(message: object) -> None:
    """Something looks wrong but the cell goes on."""
    _emit("[!]", "33", message)


def err(message: object) -> None:
    """Something failed (raise afterwards if the cell cannot go on)."""
    _emit("[x]", "31", message)
