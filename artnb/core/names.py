"""What a project, a model and an adapter may be called: each name becomes a folder of the run directory or an
engine's adapter key, so it is checked where it enters, with the rule and an example in the error.

Kept apart from store.py (which reads and writes runs with pandas) so that the engine servers can check the
adapter names they are sent without importing the run store.
"""

from __future__ import annotations

import re
from typing import Any

_NAME = re.compile(r"^\w[\w.\- ]{0,127}$")
_ART_STEP = re.compile(r"^(?P<name>.+):step(?P<step>\d+)$")


def from_art_step(model: str) -> str:
    """`agent@3` for ART's serverless spelling `agent:step3`; any other name unchanged.

    No model name contains ':' (check_name), so the spelling cannot be mistaken for a name of its own.
    """
    match = _ART_STEP.match(model) if isinstance(model, str) else None
    return f"{match['name']}@{int(match['step'])}" if match else model


def check_name(value: str, what: str = "name") -> str:
    """`value` if it is a safe single path component for a project or model name; else a ValueError with the rule."""
    if not isinstance(value, str) or not _NAME.match(value) or value.endswith((" ", ".")) or "@" in value:
        raise ValueError(
            f"{what}={value!r} is not allowed: it names a folder of the run directory, so it must be 1-128 "
            "letters, digits, '_', '-', '.' or spaces, start with a letter, digit or '_', not end with '.' "
            "or a space, and contain no '/', '\\' or '@' ('@' separates a model from its step in "
            f"'name@step'). For example {_suggest(value)!r}"
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
        ok = not at or step.isdigit()
    if not ok:
        raise ValueError(
            f"adapter name {value!r} is not allowed: use a model name (letters, digits, '_', '-', '.' or spaces; "
            "no '/', '\\' or '..'), optionally followed by '@' and a step number, e.g. 'agent@3'"
        )
    return value


def _suggest(value: Any) -> str:
    text = re.sub(r"[^\w.\- ]+", "-", str(value)).strip(" .-") or "agent-001"
    return text[:128]
