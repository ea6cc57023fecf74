"""What the machine costs by the hour, billed into the training steps' history rows (ART's
`LocalBackend(gpu_cost_per_hour_usd=...)`), so `model.history()`, W&B and Trackio show what each step cost beside
what the judges cost.

A rented GPU is paid for while rollouts run, while the trainer trains and while the notebook waits, so each
committed step's row gets `costs/gpu/usd`: the hours since the backend's previous committed step (of any of its
models), or since the backend was made, times the price. Models sharing one backend share one clock, so no
hour is billed twice, and the rows add up to at most the time the backend was up: what follows the last committed
step (final evaluations, idle time before close) and a cloud machine's provisioning are not in any row. A step
that fails before its commit leaves its hours to the next one.
"""

from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass, field

from ..core import metric_names as names

COST_KEY = names.cost("gpu", "usd")


def checked_price(usd_per_hour: object) -> float:
    """`gpu_cost_per_hour_usd` as a float, or a ValueError naming what to pass (artnb serve and SkyPilot check
    it before anything starts)."""
    if isinstance(usd_per_hour, numbers.Real) and not isinstance(usd_per_hour, bool):  # numpy's, Fraction too
        price = float(usd_per_hour)
        if math.isfinite(price) and price >= 0:
            return price
    raise ValueError(
        f"gpu_cost_per_hour_usd={usd_per_hour!r}: pass the machine's price in US dollars per hour, a number >= 0 "
        "(e.g. 2.5 for an H100 at $2.50/h), or None to record no machine cost"
    )


@dataclass
class HourlyBill:
    """One backend's clock: `take()` at each commit, `give_back()` when that commit fails."""

    usd_per_hour: float
    _since: float = field(default_factory=time.monotonic, repr=False)
    _carried_usd: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        self.usd_per_hour = checked_price(self.usd_per_hour)

    def take(self) -> float:
        """The dollars since the last take (plus any given back), and the clock restarts now."""
        now = time.monotonic()
        usd = self._carried_usd + (now - self._since) * self.usd_per_hour / 3600
        self._since, self._carried_usd = now, 0.0
        return usd

    def give_back(self, usd: float) -> None:
        """A step that took `usd` did not commit: the next step's row carries it."""
        self._carried_usd += usd
