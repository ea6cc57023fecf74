"""Warnings for the user: shown at the user's own line, and settings that mean nothing here reported once.

`warn_user` attributes a warning to the first frame outside artnb (the notebook cell or script line that called
artnb), however deep inside artnb it is raised, so `warnings`' once-per-location filter and the printed location
make sense to the user.

ART's notebooks set GPU and infrastructure knobs (Unsloth 4-bit loading, vLLM GPU memory shares, Megatron
topology). Rejecting them would break the notebook on its first cell; silently dropping them would hide that a
setting the user chose does nothing. So they are accepted, and `report_ignored` says so once per name.
"""

from __future__ import annotations

import sys
import warnings

_reported: set[str] = set()


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn(message)`, attributed to the nearest caller outside the artnb package."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] == "artnb":
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level - 1 if frame is None else level)


def report_ignored(name: str, why: str) -> None:
    """Warn once per process that setting `name` has no effect here, and why."""
    if name in _reported:
        return
    _reported.add(name)
    warn_user(f"artnb: {name} is accepted for ART compatibility but ignored here: {why}")
