"""What the machine costs by the hour, billed into the training steps' history rows (ART's
`LocalBackend(gpu_cost_per_hour_usd=...)`), so `model.history()`, W&B and Trackio show what each step cost beside
what the judges cost.

A rented GPU is paid for while rollouts run, while the trainer trains and while the notebook waits, so each
committed step's row gets `costs/gpu/usd`: the hours since the backend's previous committed step (of any of its
models), or since the backend was made, times the price. Summed over the rows it is the time the backend has
been up. Models sharing one backend share one clock, so no hour is billed twice; a step that fails before its
commit leaves its hours to the next one.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from ..core import metric_names as names

COST_KEY = names.cost("gpu", "usd")


@dataclass
class HourlyBill:
    """One backend's clock: `take()` at each commit, `give_back()` when that commit fails."""

    usd_per_hour: float
    _since: float = field(default_factory=time.monotonic, repr=False)
    _carried_usd: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        rate = self.usd_per_hour
        if (
            isinstance(rate, bool)
            or not isinstance(rate, (int, float))
            or not math.isfinite(rate)
            or rate < 0
        ):
            raise ValueError(
                f"gpu_cost_per_hour_usd={rate!r}: pass the machine's price in US dollars per hour, a number >= 0 "
                "(e.g. 2.5 for an H100 at $2.50/h), or None to record no machine cost"
            )

    def take(self) -> float:
        """The dollars since the last take (plus any given back), and the clock restarts now."""
        now = time.monotonic()
        usd = self._carried_usd + (now - self._since) * self.usd_per_hour / 3600
        self._since, self._carried_usd = now, 0.0
        return usd

    def give_back(self, usd: float) -> None:
        """A step that took `usd` did not commit: the next step's row carries it."""
        self._carried_usd += usd
