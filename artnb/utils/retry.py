"""ART's `art.utils.retry` module path (`from art.utils.retry import retry`): artnb's one retry decorator,
`artnb.core.gather.retry` (also `art.retry` and `art.utils.retry`)."""

from __future__ import annotations

from ..core.gather import retry

__all__ = ["retry"]
