"""ART's temperature annealing: the sampling temperature a model's engine uses when a request names none, moved
along a schedule by each training step (`model.set_temperature_annealer(art.LinearTemperatureAnnealer(...))`).

ART restarted its inference server at every step to change that default. Here the engine takes the new default at
once (`Engine.set_default_temperature`, a control call): no restart, and it applies to every client of the endpoint,
`model.openai_client()` or one of the user's own. A request that names a temperature keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LinearTemperatureAnnealer:
    """Temperatures from `start` to `end` in `steps` equal moves, then `end` for good.

    >>> annealer = LinearTemperatureAnnealer(start=1.0, end=0.1, steps=4)
    >>> [round(annealer.step(), 2) for _ in range(5)]
    [1.0, 0.7, 0.4, 0.1, 0.1]

    `step()` returns the next temperature: a model calls it once when the annealer is set (rollouts before the
    first training step sample at `start`) and once after each step it trains.
    """

    start: float
    end: float
    steps: int
    _taken: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        for name, value in (("start", self.start), ("end", self.end)):
            if not 0 <= value <= 2:
                raise ValueError(f"{name}={value}: a sampling temperature is between 0 and 2")
        if self.steps < 1:
            raise ValueError(f"steps={self.steps}: the schedule needs at least 1 step")

    def step(self) -> float:
        """The next temperature of the schedule."""
        fraction = min(self._taken / max(self.steps - 1, 1), 1.0)
        self._taken += 1
        return self.start + (self.end - self.start) * fraction
