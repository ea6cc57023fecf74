"""ART's `art.metrics`: `track_api_cost` counts the spend of API calls artnb does not make itself;
`MetricsBuilder` (what `model.metrics_builder()` returns) takes durations, data counts, idle times and prices.

    @art.metrics.track_api_cost(source="tools/search", provider="openai", model_name="gpt-4.1-mini")
    async def ask(question): return await client.chat.completions.create(...)

Each call's response (anything with `usage`: OpenAI, litellm, Anthropic) adds its tokens and litellm's price
estimate to `costs/{source}/...` in the next history row (see artnb/core/costs.py for where costs go).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from pydantic import BaseModel

from .core import costs
from .core.metrics_builder import MetricsBuilder

F = TypeVar("F", bound=Callable[..., Any])


def track_api_cost(
    source: str, provider: str | None = None, model_name: str | None = None
) -> Callable[[F], F]:
    """Decorate a function (sync or async) that returns an API response; its usage and price are recorded under
    `source`. `provider`/`model_name` name the priced model when the response does not (e.g. "openai", "gpt-4o")."""
    model = f"{provider}/{model_name}" if provider and model_name else model_name
    costs.CostLedger().add(source)  # a bad source name fails at decoration, not at the first call

    def decorate(fn: F) -> F:
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def tracked_async(*args: Any, **kwargs: Any) -> Any:
                response = await fn(*args, **kwargs)
                costs.record(source, response, model=model)
                return response

            return tracked_async  # type: ignore[return-value]

        @functools.wraps(fn)
        def tracked(*args: Any, **kwargs: Any) -> Any:
            response = fn(*args, **kwargs)
            costs.record(source, response, model=model)
            return response

        return tracked  # type: ignore[return-value]

    return decorate


class MetricDefinition(BaseModel):
    """ART's description of one history metric, for dashboards: its key, a title and a sentence, its kind, unit
    and direction. artnb's own metrics are described by `artnb.core.metric_names.describe(key)`; this type is
    for code that lists metrics the way ART's pipeline trainer does."""

    key: str
    title: str
    description: str
    kind: Literal["counter", "duration", "gauge", "rate", "ratio", "score"]
    unit: str | None = None
    higher_is_better: bool | None = None
    dashboard_default: bool = False
    score_component: bool = False


__all__ = ["MetricDefinition", "MetricsBuilder", "track_api_cost"]
