"""GRPO maths: group-relative advantages and the clipped policy-gradient losses, in plain torch."""

from __future__ import annotations

import math
from collections.abc import Sequence


def group_advantages(rewards: Sequence[float], scale_rewards: bool = True) -> list[float]:
    """A_i = R_i - mean(R), divided by (population std + 1e-6) when `scale_rewards` (Dr. GRPO: False)."""
    n = len(rewards)
    if n == 0:
        return []
    mean = sum(rewards) / n
    centred = [r - mean for r in rewards]
    if not scale_rewards:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / n)
    return [c / (std + 1e-6) for c in centred]
