"""Confidence intervals for "did training help?": a percentile bootstrap over held-out scenarios and seeds.

Why a bootstrap: an agent's rewards are lumpy and bounded (a game is won, drawn, lost or forfeited), and an
evaluation affords 16-64 scenarios, so a normal interval around the mean is a poor guide; resampling the
scenarios assumes nothing about how rewards are distributed.

Why two levels: a model trained with another seed (other training scenarios, other samples, another LoRA
initialisation) is another draw of training itself, and runs differ. When the values come from several runs,
`bootstrap_mean` resamples runs, then scenarios within each resampled run, so the interval covers both the
scenarios and the seeds. With one run it is the plain bootstrap over scenarios. With three runs the run level is
coarse (ten distinct draws), so its intervals are wide where runs disagree: which is what a reader should see.

Why paired (`core.evaluate.paired_difference`): base and trained play the same scenarios, and scenarios differ far
more from each other than the two models do; the interval of the per-scenario differences is much narrower than
two separate intervals would suggest.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

RESAMPLES = 10_000  # the percentiles of 10k resamples move by well under 1% of the interval between seeds
# A bootstrap of n equal differences is the zero-width interval [d, d] for any n, so below some n the interval
# cannot establish a sign. 6: the fewest values at which even a unanimous sign is significant at 5% two-sided
# (sign test: 2 * 0.5**6 = 0.031; with 5 it is 0.0625).
MIN_VALUES_FOR_A_VERDICT = 6


@dataclass(frozen=True)
class Interval:
    """A mean and its confidence interval, with how many values and runs it rests on."""

    mean: float
    low: float
    high: float
    n: int  # values (scenarios, or scenario-runs when several runs)
    runs: int = 1
    confidence: float = 0.95

    def excludes(self, value: float = 0.0) -> bool:
        """True when `value` lies outside the interval."""
        return value < self.low or value > self.high

    def establishes(self, value: float = 0.0) -> bool:
        """True when the interval excludes `value` and rests on enough values to say so
        (MIN_VALUES_FOR_A_VERDICT): for a difference, its sign is established."""
        return self.n >= MIN_VALUES_FOR_A_VERDICT and self.excludes(value)

    def __str__(self) -> str:
        return f"{self.mean:+.3f} [{self.low:+.3f}, {self.high:+.3f}]"


def bootstrap_mean(
    values: Sequence[float],
    runs: Sequence[Hashable] | None = None,
    *,
    confidence: float = 0.95,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> Interval:
    """The mean of `values` with a percentile-bootstrap interval; `runs[i]` names the run value i came from.

    >>> str(bootstrap_mean([0.0, 1.0]))  # resampled means are 0, 0.5 or 1 with chances 1/4, 1/2, 1/4
    '+0.500 [+0.000, +1.000]'
    """
    x = np.asarray(values, dtype=float)
    if x.ndim != 1 or x.size == 0:
        raise ValueError("bootstrap_mean needs at least one value")
    if not np.isfinite(x).all():
        raise ValueError(
            f"{int((~np.isfinite(x)).sum())} of {x.size} values are NaN or infinite: drop failed rollouts "
            "(their rows have an `error`) before computing an interval"
        )
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence}: use a share between 0 and 1, e.g. 0.95")
    if runs is not None and len(runs) != x.size:
        raise ValueError(f"{len(runs)} run labels for {x.size} values: give one run label per value")
    groups = [x] if runs is None else [x[np.asarray(_codes(runs)) == k] for k in range(len(set(runs)))]
    rng = np.random.default_rng(seed)
    means = _two_level(groups, rng, resamples) if len(groups) > 1 else _one_level(x, rng, resamples)
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    # Float rounding can put a constant's quantile a hair off the mean; an interval always holds its mean.
    mean = float(x.mean())
    return Interval(mean, min(float(low), mean), max(float(high), mean), int(x.size), len(groups), confidence)


def _codes(runs: Sequence[Hashable]) -> list[int]:
    order = {run: k for k, run in enumerate(dict.fromkeys(runs))}
    return [order[run] for run in runs]


def _one_level(x: np.ndarray, rng: np.random.Generator, resamples: int) -> np.ndarray:
    return np.concatenate(
        [x[rng.integers(0, x.size, size=(n, x.size))].mean(axis=1) for n in _chunks(resamples, x.size)]
    )


def _two_level(groups: list[np.ndarray], rng: np.random.Generator, resamples: int) -> np.ndarray:
    """Resample the runs, then each drawn run's values; the mean over all values drawn (runs weigh by size)."""
    k = len(groups)
    drawn = rng.integers(0, k, size=(resamples, k))  # which run fills each of the k slots
    sums = np.zeros((resamples, k))
    for run, values in enumerate(groups):
        inner = np.concatenate(
            [
                values[rng.integers(0, values.size, size=(n, k, values.size))].sum(axis=2)
                for n in _chunks(resamples, k * values.size)
            ]
        )
        sums += np.where(drawn == run, inner, 0.0)
    sizes = np.array([g.size for g in groups])[drawn]
    return sums.sum(axis=1) / sizes.sum(axis=1)


def _chunks(resamples: int, width: int, cells: int = 4_000_000) -> list[int]:
    """Resamples per batch so that no index matrix holds more than `cells` entries (memory stays ~32 MB)."""
    step = max(1, cells // max(width, 1))
    return [min(step, resamples - i) for i in range(0, resamples, step)]
