"""Judge requests with limits of artnb's own: a time bound, retries with backoff, and errors that say what to do.

Why not litellm's defaults: they would let one stuck judge stall a whole training step (600 s per try, retries
hidden inside the OpenAI client). Here each request is bounded in time (`JudgeLimits.timeout_s`, enforced by
asyncio too, so a server that stalls after its headers cannot run past it), and a timeout, a dropped connection
or HTTP 408/409/429/5xx is retried up to `max_attempts` with exponential backoff and full jitter, waiting a
server's `Retry-After` when it sends one. litellm itself is told never to retry, so the attempts counted are the
requests sent. Any other 4xx (bad request, bad key) fails at once with the judge's message: sending it again
cannot help. What is left after the last attempt is a `JudgeRequestError` naming the judge, the attempts and the
last failure. RULER (ruler.py) asks its judge through `request_judge`.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import random
import time
from collections.abc import Mapping
from typing import Any, cast

import openai
from pydantic import BaseModel, ConfigDict, Field

from . import costs

log = logging.getLogger("artnb")


class JudgeLimits(BaseModel):
    """How long RULER waits for its judge and how often it tries again, so a stuck judge costs bounded time.

    A retry follows a timeout, a failed connection or HTTP 408/409/429/5xx; the wait before retry n is a random
    time up to `min(backoff_max_s, backoff_initial_s * 2**(n-1))`, or the server's `Retry-After` when it sends
    one. One `ruler` call therefore takes at most about
    `max_attempts * timeout_s + (max_attempts - 1) * backoff_max_s` seconds (7.5 minutes with the defaults),
    plus one more request when the judge's reply is unusable (see `ruler`).

    Example, a judge that is slow but must not hold a training step for long:
        limits = JudgeLimits(timeout_s=180, max_attempts=2)
        group = await art.ruler_score_group(group, "openai/o4-mini", limits=limits)
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    timeout_s: float = Field(
        default=90.0,
        gt=0,
        description="Longest one judge request may take, from sending it to the last byte of the reply; a "
        "request still unanswered then is abandoned and counts as a failed attempt. Raise it for a slow "
        "reasoning judge or large groups (a long reply takes long to write); lower it to give up on a stuck "
        "endpoint sooner.",
    )
    max_attempts: int = Field(
        default=4,
        ge=1,
        description="Most requests sent for one group, the first included: 1 never retries. Raise it for a "
        "judge that is often rate-limited or restarting; lower it when a failed group should be given up fast.",
    )
    backoff_initial_s: float = Field(
        default=1.0,
        ge=0,
        description="Longest wait before the first retry; each later retry may wait twice as long as the one "
        "before, up to backoff_max_s. Raise it for a judge whose rate limit takes long to recover.",
    )
    backoff_max_s: float = Field(
        default=30.0,
        ge=0,
        description="Longest wait between two attempts, a server's Retry-After included (a longer Retry-After "
        "is cut to this). Raise it when the judge's provider asks for long pauses and you would rather wait "
        "than fail.",
    )
    jitter: bool = Field(
        default=True,
        description="Wait a random time between 0 and the backoff delay ('full jitter'), so that groups that "
        "failed together do not all retry at the same instant. Turn it off only for reproducible waits.",
    )

    def _wait_s(self, retry: int, retry_after: float | None) -> float:
        """Seconds to wait before retry number `retry` (1 for the first)."""
        if retry_after is not None:
            return min(retry_after, self.backoff_max_s)
        ceiling = min(self.backoff_max_s, self.backoff_initial_s * 2 ** min(retry - 1, 60))
        return random.uniform(0, ceiling) if self.jitter else ceiling


class RulerError(ValueError):
    """RULER could not get usable scores from its judge; the message says why and what to change."""


class JudgeRequestError(RulerError):
    """The judge refused the request (HTTP 4xx), or failed every attempt the `JudgeLimits` allowed.

    `judge` is the litellm model (and endpoint), `attempts` the requests sent, `last_error` the last failure
    (also chained as `__cause__`).
    """

    def __init__(self, message: str, *, judge: str, attempts: int, last_error: BaseException) -> None:
        super().__init__(message)
        self.judge = judge
        self.attempts = attempts
        self.last_error = last_error


async def request_judge(
    params: dict[str, Any],
    messages: list[dict[str, Any]],
    response_format: Any,
    limits: JudgeLimits,
    attempts: int,
    sent_before: int = 0,
) -> tuple[str, int]:
    """The judge's reply text and the number of requests it took, at most `attempts`, within `limits`.

    `sent_before`: requests already sent for the same question (a reply that was unusable), counted in messages.
    """
    started = time.monotonic()
    for sent in range(sent_before + 1, sent_before + attempts + 1):
        try:
            return await _request(params, messages, response_format, limits.timeout_s), sent - sent_before
        except (asyncio.TimeoutError, openai.APIError, EmptyReply) as error:
            failure, retryable, retry_after = _describe_failure(error, limits.timeout_s)
            if not retryable:
                raise JudgeRequestError(
                    f"the judge {_where(params)} refused the request ({failure}). Not retried: the same request "
                    "would fail again. Check the model name, api_key and api_base (extra_litellm_params), or "
                    "score smaller groups if the prompt is too long",
                    judge=_where(params),
                    attempts=sent,
                    last_error=error,
                ) from error
            if sent == sent_before + attempts:
                raise JudgeRequestError(
                    f"the judge {_where(params)} failed {sent} attempt{'s' if sent > 1 else ''} in "
                    f"{time.monotonic() - started:.1f} s; the last: {failure}. Check that the endpoint is up and "
                    f"within its rate limit, allow more with limits=JudgeLimits(...) (now {limits!r}), or let the "
                    "group go: swallow_exceptions=True, or gather_trajectory_groups(after_each_errors='drop')",
                    judge=_where(params),
                    attempts=sent,
                    last_error=error,
                ) from error
            wait = limits._wait_s(sent, retry_after)
            log.warning(
                "RULER judge %s failed (attempt %d of %d): %s; retrying in %.1f s",
                _where(params),
                sent,
                sent_before + attempts,
                failure,
                wait,
            )
            await asyncio.sleep(wait)
    raise ValueError(f"attempts={attempts}: at least one request is needed")


async def _request(
    params: dict[str, Any], messages: list[dict[str, Any]], response_format: Any, timeout_s: float
) -> str:
    """One request and nothing more: litellm must not retry, and asyncio ends it at `timeout_s` whatever the
    server does (httpx's timeout only bounds each read, so a server that trickles bytes would outlast it)."""
    import litellm

    from .capture import no_capture

    call = litellm.acompletion(
        messages=messages,
        response_format=response_format,
        caching=False,
        **params,
        timeout=timeout_s,
        num_retries=0,  # litellm's own retry loop around the call
        max_retries=0,  # the OpenAI client's retries inside it (2 by default)
    )
    with no_capture():  # a judge's reply is not the policy's turn, even when a rollout asks for it
        response = cast("litellm.ModelResponse", await asyncio.wait_for(call, timeout_s))  # not streamed
    costs.record("judge/ruler", response, model=params.get("model"))
    if not response.choices:
        raise EmptyReply("the judge's reply has an empty `choices` list (no answer at all)")
    return response.choices[0].message.content or ""


class EmptyReply(Exception):
    """A reply with no choices: the server answered 200 with nothing in it; another request may do better."""


_RETRYABLE_STATUS = {408, 409, 429}  # and every 5xx
_NO_CREDENTIALS = ("Missing credentials", "api_key client option must be set")


def _describe_failure(error: BaseException, timeout_s: float) -> tuple[str, bool, float | None]:
    """What went wrong in words, whether trying again may help, and the server's Retry-After in seconds."""
    if isinstance(error, (asyncio.TimeoutError, openai.APITimeoutError)):
        return f"no reply within {timeout_s:g} s (JudgeLimits.timeout_s)", True, None
    if isinstance(error, EmptyReply):
        return str(error), True, None
    if isinstance(error, openai.APIConnectionError):
        return f"connection failed: {_brief(error)}", True, None
    if any(sign in str(error) for sign in _NO_CREDENTIALS):
        # litellm reports the OpenAI client's "no api_key" as an HTTP 500; no retry can fix it
        return (
            f"no API key for this judge ({_brief(error)}); set the provider's key (e.g. OPENAI_API_KEY, or in a "
            ".env file) or pass api_key in extra_litellm_params",
            False,
            None,
        )
    status = getattr(error, "status_code", None)
    if not isinstance(status, int):
        return _brief(error), False, None
    retryable = status in _RETRYABLE_STATUS or status >= 500
    if status == 500 and "Connection error" in str(error):
        # litellm wraps the OpenAI client's dropped or refused connection as an HTTP 500 the server never sent
        return f"connection failed: {_brief(error)}", True, None
    return f"HTTP {status}: {_brief(error)}", retryable, _retry_after_s(error)


def _retry_after_s(error: BaseException) -> float | None:
    """The wait a failed response asked for (`retry-after-ms`, `Retry-After` in seconds or as an HTTP date).

    litellm keeps the provider's headers on its exceptions as `litellm_response_headers`; openai's own
    exceptions have them on `.response.headers`."""
    response = getattr(error, "response", None)
    for headers in (getattr(error, "litellm_response_headers", None), getattr(response, "headers", None)):
        if not isinstance(headers, Mapping):
            continue
        lower = {str(k).lower(): str(v).strip() for k, v in headers.items()}
        try:
            if "retry-after-ms" in lower:
                return max(0.0, float(lower["retry-after-ms"]) / 1000)
            if "retry-after" in lower:
                return max(0.0, float(lower["retry-after"]))
        except ValueError:
            pass
        try:
            when = email.utils.parsedate_to_datetime(lower.get("retry-after", ""))
            return max(0.0, when.timestamp() - time.time())
        except (TypeError, ValueError):
            continue
    return None


def _brief(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 400 else text[:400] + "..."


def _where(params: dict[str, Any]) -> str:
    base = params.get("api_base") or params.get("base_url")
    return f"{params['model']} at {base}" if base else params["model"]


def fold_litellm_limits(
    limits: JudgeLimits, extra: dict[str, Any] | None
) -> tuple[JudgeLimits, dict[str, Any]]:
    """Move litellm's `timeout` / `num_retries` / `max_retries` arguments into the limits (see `ruler`)."""
    if not isinstance(limits, JudgeLimits):
        raise TypeError(f"limits must be an art JudgeLimits(...), got {type(limits).__name__}")
    extra = dict(extra or {})
    update: dict[str, Any] = {}
    timeout = extra.pop("timeout", None)
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise ValueError(
                f"extra_litellm_params['timeout'] must be a number of seconds, got {timeout!r}; "
                "or pass limits=JudgeLimits(timeout_s=...)"
            )
        update["timeout_s"] = timeout
    retries = [extra.pop(k) for k in ("num_retries", "max_retries") if k in extra]
    if retries and retries[0] is not None:  # litellm too lets num_retries win over max_retries
        update["max_attempts"] = int(retries[0]) + 1
    both = sorted(set(update) & limits.model_fields_set)
    if both:
        raise ValueError(
            f"{' and '.join(both)} set twice, in limits and in extra_litellm_params "
            "(timeout / num_retries / max_retries): keep one, preferably limits=JudgeLimits(...)"
        )
    return (JudgeLimits(**{**limits.model_dump(), **update}) if update else limits), extra
