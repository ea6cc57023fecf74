"""ART's `art.utils.log_http_errors`: an async function's HTTP status errors re-raised with what the server said.

httpx's `HTTPStatusError` names the status and URL but not the body, where servers (FastAPI: `{"detail": ...}`)
say what was wrong; the decorator puts that detail in the message, keeping the original as the cause.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

import httpx

P = ParamSpec("P")
R = TypeVar("R")


class HTTPErrorDetail(Exception):
    """An HTTP error response, with the server's `detail`; `__cause__` is httpx's HTTPStatusError."""


def log_http_errors(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """Decorate an async function: an `httpx.HTTPStatusError` it raises becomes an HTTPErrorDetail reading
    "[HTTP <status>] <url> <detail>". A body that is not JSON leaves the original error as it was."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await fn(*args, **kwargs)
        except httpx.HTTPStatusError as error:
            body = _json_body(error.response)
            if body is _NOT_JSON:
                raise
            detail = body.get("detail") if isinstance(body, dict) else None
            raise HTTPErrorDetail(
                f"[HTTP {error.response.status_code}] {error.request.url} {detail}"
            ) from error

    return wrapper


_NOT_JSON = object()


def _json_body(response: httpx.Response) -> object:
    try:
        return response.json()
    except ValueError:
        return _NOT_JSON
