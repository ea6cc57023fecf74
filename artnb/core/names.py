"""What a project, a model, an adapter and a logged split may be called, and what a step may be: each becomes a
folder or file of the run directory or an engine's adapter key, so it is checked where it enters, with the rule
and an example in the error.

Kept apart from store.py (which reads and writes runs with pandas) so that the engine servers can check the
adapter names they are sent without importing the run store.
"""

from __future__ import annotations

import difflib
import numbers
import re
from collections.abc import Iterable
from typing import Any

# Used with fullmatch: `$` would also match before a trailing newline, letting "agent\n" name a folder.
_NAME = re.compile(r"\w[\w.\- ]{0,127}")
_ART_STEP = re.compile(r"(?P<name>.+):step(?P<step>\d+)")


def from_art_step(model: str) -> str:
    """`agent@3` for ART's serverless spelling `agent:step3`; any other name unchanged.

    No model name contains ':' (check_name), so the spelling cannot be mistaken for a name of its own.
    """
    match = _ART_STEP.fullmatch(model) if isinstance(model, str) else None
    return f"{match['name']}@{int(match['step'])}" if match else model


def check_name(value: str, what: str = "name", example: str = "agent-001") -> str:
    """`value` if it is a safe single path component for a project, model or split name; else a ValueError with
    the rule and a suggestion (`example` when nothing of `value` is usable)."""
    if not isinstance(value, str) or not _NAME.fullmatch(value) or value.endswith((" ", ".")) or "@" in value:
        raise ValueError(
            f"{what}={value!r} is not allowed: it names a folder of the run directory, so it must be 1-128 "
            "letters, digits, '_', '-', '.' or spaces, start with a letter, digit or '_', not end with '.' "
            "or a space, and contain no '/', '\\' or '@' ('@' separates a model from its step in "
            f"'name@step'). For example {_suggest(value, example)!r}"
        )
    return value


def check_adapter_name(value: str) -> str:
    """`value` if it names an adapter as artnb serves them: a model name, optionally '@' and a step
    (`agent`, `agent@3`); else a ValueError with the rule. Engines take adapter names over HTTP, so the rule
    holds where every name enters, whatever a name is used for there."""
    name, at, step = value.rpartition("@") if isinstance(value, str) and "@" in value else (value, "", "")
    try:
        check_name(name, "adapter name")
    except ValueError:
        ok = False
    else:
        ok = not at or (step.isascii() and step.isdigit())  # isdigit alone accepts '²', which int() refuses
    if not ok:
        raise ValueError(
            f"adapter name {value!r} is not allowed: use a model name (letters, digits, '_', '-', '.' or spaces; "
            "no '/', '\\' or '..'), optionally followed by '@' and a step number, e.g. 'agent@3'"
        )
    return value


def nearest(name: str, known: Iterable[str], cutoff: float = 0.6) -> list[str]:
    """The known names nearest to `name` (a likely misspelling of them), best first: for "did you mean"."""
    return difflib.get_close_matches(str(name), sorted(known), n=3, cutoff=cutoff)


def check_split(split: Any) -> str:
    """`split` if it can name the folder `trajectories/{split}/` and prefix metric names (`val/reward`); else a
    TypeError or ValueError saying what to pass. Checked before anything is logged, so a bad split never writes
    outside the run directory nor leaves files no reader finds."""
    if not isinstance(split, str):
        raise TypeError(
            f"split must be a string naming the data split (got {type(split).__name__} {split!r}); "
            "pass e.g. split='val' or split='train'"
        )
    return check_name(split, "split", example="val")


def check_step(step: Any) -> int:
    """`step` as an int if it is a whole number >= 0 (an int or a numpy integer; not a bool); else a TypeError
    or ValueError. A step names the file `{step:04d}.parquet` and the history row's x-axis, so anything else
    would fail deep in a write or leave a row no plot can place."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(
            f"step must be a whole number >= 0 (got {type(step).__name__} {step!r}); pass an int such as "
            "step=3, or leave step out to use the model's current step"
        )
    if step < 0:
        raise ValueError(
            f"step must be >= 0 (got {step}); pass the training step the data belongs to (e.g. "
            "`await model.get_step()`), or leave step out"
        )
    return int(step)


def _suggest(value: Any, fallback: str = "agent-001") -> str:
    text = re.sub(r"[^\w.\- ]+", "-", str(value)).strip(" .-") or fallback
    return text[:128]
