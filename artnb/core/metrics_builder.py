"""ART's metrics builder: what a loop measures between two history rows (durations, data counts, idle time,
spend), recorded with the model's next row.

    builder = model.metrics_builder()
    with builder.measure("time/step_actor_s"):
        groups = await art.gather_trajectory_groups(...)
    builder.add_data(step_num_scenarios=len(groups), scenario_ids=[g.metadata["id"] for g in groups])
    builder.add_idle_times(step_trainer_idle_s=3.2)
    await model.log(groups, split="train")   # the row holds time/step_actor_s, data/..., throughput/...

A builder is a `CostLedger` (artnb/core/costs.py) too: API spend recorded while it is active
(`model.activate_metrics_context(...)`) lands in it. Values added between rows are summed; draining (a history
row is written) starts them again. Unlike ART, no `.../cum/...` running totals are kept: the history holds
every step's value, and the plots sum them where a total is wanted (`data/num_unique_scenarios` is the one
cumulative value, since a set of ids cannot be summed from per-step counts).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator

from . import costs
from . import metric_names as names


class MetricsBuilder(costs.CostLedger):
    """Metrics for the next history row of one model; thread-safe. `cost_context` names the phase the spend
    belongs to (ART's "train"/"eval"); artnb's cost names carry their source instead, so it is kept as a label."""

    def __init__(self, cost_context: str | None = None) -> None:
        super().__init__()
        self.cost_context = cost_context
        self._values_lock = threading.Lock()
        self._values: dict[str, float] = defaultdict(float)
        self._scenario_ids: set[str] = set()

    def add_metric(self, key: str, value: float) -> None:
        """Add `value` to `key` (`section/name`, e.g. "time/step_tool_s") for the next row."""
        section, _, name = key.partition("/")
        if not section or not name or "/cum/" in f"/{key}/":
            raise ValueError(
                f"metric {key!r}: use 'section/name' (e.g. 'time/step_tool_s'); running totals ('.../cum/...') "
                "are not recorded, each row holds the step's own value"
            )
        if section == "costs":
            raise ValueError(f"metric {key!r}: spend goes through add_cost(source, usd) or track_api_cost")
        with self._values_lock:
            self._values[key] += float(value)

    @contextlib.contextmanager
    def measure(self, key: str) -> Iterator[None]:
        """Add the seconds the block takes to `key` (e.g. "time/step_actor_s"), also when it raises."""
        self.add_metric(key, 0.0)  # a bad key fails before the block runs
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add_metric(key, time.perf_counter() - started)

    def add_data(
        self,
        step_num_scenarios: int | None = None,
        step_actor_tokens: int | None = None,
        scenario_ids: Iterable[object] | None = None,
    ) -> None:
        """Scenarios and sampled tokens of this step; `scenario_ids` also grow `data/num_unique_scenarios`."""
        if step_num_scenarios is not None:
            self.add_metric(names.data("step_num_scenarios"), step_num_scenarios)
        if step_actor_tokens is not None:
            self.add_metric(names.data("step_actor_tokens"), step_actor_tokens)
        if scenario_ids is not None:
            with self._values_lock:
                self._scenario_ids.update(str(x) for x in scenario_ids)
                self._values[names.data("num_unique_scenarios")] = float(len(self._scenario_ids))

    def add_user_timing(
        self,
        step_wall_s: float | None = None,
        step_actor_s: float | None = None,
        step_eval_s: float | None = None,
    ) -> None:
        """Durations the caller timed itself: the whole step, its rollouts, its evaluation."""
        for name, value in (("step_wall_s", step_wall_s), ("step_actor_s", step_actor_s)):
            if value is not None:
                self.add_metric(names.time(name), value)
        if step_eval_s is not None:
            self.add_metric(names.time("step_eval_s"), step_eval_s)

    def add_idle_times(
        self, step_trainer_idle_s: float | None = None, step_actor_idle_s: float | None = None
    ) -> None:
        """Seconds the trainer waited for rollouts, and rollouts waited for the trainer, in this step."""
        if step_trainer_idle_s is not None:
            self.add_metric(names.throughput("step_trainer_idle_s"), step_trainer_idle_s)
        if step_actor_idle_s is not None:
            self.add_metric(names.throughput("step_actor_idle_s"), step_actor_idle_s)

    def add_cost(self, source: str, usd: float) -> None:
        """Spend that is not an API response (a tool's fee, GPU time): `costs/{source}/usd`."""
        self.add(source, usd=usd, requests=0)

    def register_model_pricing(
        self,
        model_name: str,
        *,
        prompt_per_million: float,
        completion_per_million: float,
        cached_prompt_per_million: float | None = None,
    ) -> None:
        """Price `model_name` (as a response or `track_api_cost` names it) in USD per million tokens, for models
        litellm does not know (fine-tunes, local servers) or prices differently. Applies to every builder."""
        costs.register_pricing(
            model_name,
            prompt_per_million=prompt_per_million,
            completion_per_million=completion_per_million,
            cached_prompt_per_million=cached_prompt_per_million,
        )

    def drain(self) -> dict[str, float]:
        """The step's metrics (spend, durations, counts) since the last drain, and start again."""
        out = super().drain()
        with self._values_lock:
            values, self._values = self._values, defaultdict(float)
        out.update(values)
        return out
