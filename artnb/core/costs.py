"""Spend on judges and hosted models, recorded with the next history row as `costs/{source}/{kind}`.

Calls made through artnb are counted: RULER's judge requests (source `judge/ruler`), requests through a hosted
`Model`'s `openai_client()` (source `model/{name}`), and any function decorated with `art.metrics.track_api_cost`.
Each adds its tokens, a request, and litellm's price estimate in USD when litellm knows the model's price
(`costs/.../usd` is absent otherwise: an unknown price is not $0).

Where a cost goes: into the ledger active in the current context (`with model.activate_metrics_context(
model.metrics_builder()):`, ART's calls), else into the calling hosted model's own ledger, else into a shared one
for calls that name no model (a judge scoring groups). A history row recorded by a model takes its own ledger and
the shared one (`drain_for`), so each cost is recorded once, with the step during which it was spent.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from . import metrics as names


class CostLedger:
    """Token counts, requests and USD per source, since the last `drain()`; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))

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


@contextlib.contextmanager
def activate(ledger: CostLedger) -> Iterator[CostLedger]:
    """Costs recorded inside the block (and tasks started in it) go to `ledger`."""
    token = _active.set(ledger)
    try:
        yield ledger
    finally:
        _active.reset(token)


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


def price(response: Any, model: str | None, prompt_tokens: int, completion_tokens: int) -> float | None:
    """litellm's estimate in USD, or None when it does not know the model's price."""
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


def _field(usage: Any, *keys: str) -> int:
    for key in keys:
        value = usage.get(key) if isinstance(usage, dict) else getattr(usage, key, None)
        if isinstance(value, (int, float)):
            return int(value)
    return 0
