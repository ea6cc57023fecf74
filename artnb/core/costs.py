"""Spend on judges and hosted models, recorded with the next history row as `costs/{source}/{kind}`.

Calls made through artnb are counted: RULER's judge requests (source `judge/ruler`), requests through a hosted
`Model`'s `openai_client()` (source `model/{name}`), and any function decorated with `art.metrics.track_api_cost`.
Each adds its tokens, a request, and its price in USD: the price registered for the model
(`register_pricing`, or a metrics builder's `register_model_pricing`), else litellm's estimate when litellm knows
the model (`costs/.../usd` is absent otherwise: an unknown price is not $0).

Where a cost goes: into the ledger active in the current context (`with model.activate_metrics_context(
model.metrics_builder()):`, ART's calls), else into the calling hosted model's own ledger, else into a shared one
for calls that name no model (a judge scoring groups). A history row recorded by a model takes its own ledger and
the shared one (`drain_for`), so each cost is recorded once, with the step during which it was spent.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from . import metric_names as names


class CostLedger:
    """Token counts, requests and USD per source, since the last `drain()`; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: defaultdict[str, defaultdict[str, float]] = defaultdict(lambda: defaultdict(float))

    def add(
        self,
        source: str,
        *,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        usd: float | None = None,
        requests: int = 1,
    ) -> None:
        names.cost(source, "usd")  # a bad source fails here, not when the row is written
        with self._lock:
            totals = self._totals[source]
            totals["prompt_tokens"] += prompt_tokens
            totals["completion_tokens"] += completion_tokens
            totals["requests"] += requests
            if usd is not None:
                totals["usd"] += usd

    def forward(self, other: CostLedger) -> dict[str, float]:
        """Move everything recorded here into `other` (whose next drain reports it); returns it as metrics."""
        with self._lock:
            totals, self._totals = self._totals, defaultdict(lambda: defaultdict(float))
        for source, kinds in totals.items():
            other.add(
                source,
                prompt_tokens=int(kinds.get("prompt_tokens", 0)),
                completion_tokens=int(kinds.get("completion_tokens", 0)),
                usd=kinds.get("usd"),
                requests=int(kinds.get("requests", 0)),
            )
        return {names.cost(source, kind): v for source, kinds in totals.items() for kind, v in kinds.items()}

    def drain(self) -> dict[str, float]:
        """The metrics accumulated since the last drain (`costs/{source}/{kind}`), and start again."""
        with self._lock:
            totals, self._totals = self._totals, defaultdict(lambda: defaultdict(float))
        return {
            names.cost(source, kind): value
            for source, kinds in totals.items()
            for kind, value in kinds.items()
        }


_active: ContextVar[CostLedger | None] = ContextVar("artnb_cost_ledger", default=None)
shared = CostLedger()  # calls that name no model: a judge scoring groups, track_api_cost outside a context


class Activation:
    """`ledger` receives the costs recorded from its creation on, in this context and tasks started from it;
    as a `with` block, until the block ends."""

    def __init__(self, ledger: CostLedger) -> None:
        self.ledger = ledger
        self._token = _active.set(ledger)

    def __enter__(self) -> CostLedger:
        return self.ledger

    def __exit__(self, *exc: object) -> None:
        _active.reset(self._token)


def active() -> CostLedger | None:
    """The ledger activated in this context (`model.activate_metrics_context(...)`), or None."""
    return _active.get()


def activate(ledger: CostLedger) -> Activation:
    """`with activate(ledger):` costs recorded inside the block (and tasks started in it) go to `ledger`."""
    return Activation(ledger)


def record(source: str, response: Any, model: str | None = None, ledger: CostLedger | None = None) -> None:
    """Count one API response (an OpenAI or litellm completion, or anything with `usage`) under `source`."""
    usage = getattr(response, "usage", None)
    if usage is None and isinstance(response, dict):
        usage = response.get("usage")
    prompt = _field(usage, "prompt_tokens", "input_tokens")
    completion = _field(usage, "completion_tokens", "output_tokens")
    target = next(x for x in (_active.get(), ledger, shared) if x is not None)
    target.add(
        source,
        prompt_tokens=prompt,
        completion_tokens=completion,
        usd=price(response, model, prompt, completion),
    )


@dataclass(frozen=True)
class Pricing:
    """USD per million tokens."""

    prompt: float
    completion: float
    cached_prompt: float | None = None  # cached prompt tokens, when the provider bills them differently


_pricing: dict[str, Pricing] = {}


def register_pricing(
    model_name: str,
    *,
    prompt_per_million: float,
    completion_per_million: float,
    cached_prompt_per_million: float | None = None,
) -> None:
    """Price `model_name` for every cost recorded from now on (it wins over litellm's table)."""
    prices = (prompt_per_million, completion_per_million, cached_prompt_per_million or 0.0)
    if not model_name or any(not isinstance(x, (int, float)) or x < 0 for x in prices):
        raise ValueError(
            f"register_model_pricing({model_name!r}, ...): give the model's name and prices in USD per million "
            "tokens as numbers >= 0"
        )
    _pricing[model_name] = Pricing(prompt_per_million, completion_per_million, cached_prompt_per_million)


def price(response: Any, model: str | None, prompt_tokens: int, completion_tokens: int) -> float | None:
    """The registered price, else litellm's estimate, in USD; None when neither knows the model."""
    answered = getattr(response, "model", None) or (isinstance(response, dict) and response.get("model"))
    for name in (model, answered):
        if name and (known := _pricing.get(name) or _pricing.get(str(name).split("/", 1)[-1])):
            cached = min(_cached_tokens(response), prompt_tokens) if known.cached_prompt is not None else 0
            return (
                (prompt_tokens - cached) * known.prompt
                + cached * (known.cached_prompt or 0.0)
                + completion_tokens * known.completion
            ) / 1e6
    import litellm

    # Else litellm prints its provider list for each unpriced model, such as our own engines' names.
    litellm.suppress_debug_info = True
    with contextlib.suppress(Exception):
        return float(litellm.completion_cost(completion_response=response))
    if model:
        with contextlib.suppress(Exception):
            cost_in, cost_out = litellm.cost_per_token(
                model=model, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens
            )
            return float(cost_in + cost_out)
    return None


def drain_for(ledger: CostLedger) -> dict[str, float]:
    """A model's costs since its last row: its own ledger and the shared one."""
    out = shared.drain()
    for name, value in ledger.drain().items():
        out[name] = out.get(name, 0.0) + value
    return out


def _cached_tokens(response: Any) -> int:
    usage = getattr(response, "usage", None)
    if usage is None and isinstance(response, dict):
        usage = response.get("usage")
    details = (
        usage.get("prompt_tokens_details")
        if isinstance(usage, dict)
        else getattr(usage, "prompt_tokens_details", None)
    )
    return (
        _field(details, "cached_tokens") if details is not None else _field(usage, "cache_read_input_tokens")
    )


def _field(usage: Any, *keys: str) -> int:
    for key in keys:
        value = usage.get(key) if isinstance(usage, dict) else getattr(usage, key, None)
        if isinstance(value, (int, float)):
            return int(value)
    return 0
