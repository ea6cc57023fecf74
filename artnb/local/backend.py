"""`from artnb.local.backend import LocalBackend`: ART's module path, kept for code written against it."""

from ..backends.local import LocalBackend

__all__ = ["LocalBackend"]
