"""`from artnb.local import LocalBackend`: ART's import path (`art.local`) for the backend in artnb/backends/local.py."""

from ..backends.local import LocalBackend

__all__ = ["LocalBackend"]
