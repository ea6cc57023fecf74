"""Drop per-token logprobs from anything before it is traced or printed.

A trainable turn is an OpenAI `Choice` whose `logprobs.content` holds one entry per sampled token (with its
top alternatives): most of a trajectory's size, and of no use in a trace viewer. ART's notebooks pass this
function to Weave (`weave.init(..., global_postprocess_output=strip_logprobs)`), which calls it on every
recorded output, so it must accept any object and never raise.

Same behaviour as OpenPipe ART's `art.utils.strip_logprobs.strip_logprobs`: it works on a deep copy (the
trajectory you train on keeps its logprobs); a dict loses its "logprobs" keys; an object (a pydantic model such
as `Choice` or `Trajectory`, a dataclass) gets its `logprobs` attribute set to None; lists and tuples are
walked; if the object cannot be deep-copied it is returned unchanged, with a warning in the log. Departures:
named tuples stay named tuples; classes, modules and functions are left alone (ART would rewrite their
attributes); an object met twice (a reference cycle) is walked once, where ART recurses without end.
"""

from __future__ import annotations

import copy
import inspect
import logging
import types
from typing import Any, TypeVar

log = logging.getLogger("artnb")

T = TypeVar("T")


def strip_logprobs(obj: T) -> T:
    """A copy of `obj` without logprobs (dict keys removed, attributes set to None), at any depth.

    >>> light = strip_logprobs(trajectory)  # trajectory.messages_and_choices[i].logprobs is untouched
    """
    try:
        copied = copy.deepcopy(obj)
    except Exception as exc:  # any object can reach a trace hook; an uncopyable one is passed through
        log.warning("strip_logprobs could not copy a %s (%s); returned it unchanged", type(obj).__name__, exc)
        return obj
    return _strip(copied, set())


def _strip(obj: Any, seen: set[int]) -> Any:
    if isinstance(obj, dict):
        return {k: _strip(v, seen) for k, v in obj.items() if k != "logprobs"}
    if isinstance(obj, list):
        return [_strip(v, seen) for v in obj]
    if isinstance(obj, tuple):
        items = [_strip(v, seen) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if _has_own_attributes(obj) and id(obj) not in seen:
        seen.add(id(obj))
        attributes = vars(obj)  # written directly: frozen models and validators must not stop the copy's edit
        for name, value in list(attributes.items()):
            attributes[name] = None if name == "logprobs" else _strip(value, seen)
    return obj


def _has_own_attributes(obj: Any) -> bool:
    if isinstance(obj, (type, types.ModuleType)) or inspect.isroutine(obj):
        return False
    return isinstance(getattr(obj, "__dict__", None), dict)
