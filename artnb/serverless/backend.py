"""`from artnb.serverless.backend import ServerlessBackend`: ART's module path (see artnb/serverless/__init__.py)."""

from . import ServerlessBackend

__all__ = ["ServerlessBackend"]
