"""The a+b task that benchmarks/grpo_vs_trl.py runs on artnb and on TRL: one definition, imported by both sides.

It imports nothing outside the standard library, so TRL's own virtual environment (which has no artnb) loads it
too, and both frameworks see the same prompts in the same order and score replies with the same function.

- One prompt per RL step, "What is a + b?" with one-digit a and b drawn from `random.Random(seed)`: a new
  sum each step, the same sequence for both frameworks. One digit, because the 135M model almost never adds
  larger numbers (measured: 0 of 24 samples of 12+7, 23+45 and 61+28 at temperature 1 had the sum; 2 of 8 of
  3+5), and a group whose rewards are all equal teaches nothing (artnb then skips the update, TRL runs it with
  zero advantages).
- Reward 1.0 if the reply starts with the sum, 0.3 if the sum appears anywhere in it, else 0. The sum must stand
  as a whole number ("57" does not count inside "157" or "570"). The 0.3 is a local optimum ("The answer is
  57") that both frameworks reach; it is kept as DESIGN.md section 4 measured it.
"""

from __future__ import annotations

import random
import re

PROMPT = "What is {a} + {b}?"


def problems(steps: int, seed: int = 0) -> list[tuple[int, int]]:
    """The (a, b) of each step, in order."""
    rng = random.Random(seed)
    return [(rng.randint(1, 9), rng.randint(1, 9)) for _ in range(steps)]


def messages(a: int, b: int) -> list[dict[str, str]]:
    """The chat prompt of one problem (the model's chat template adds its own default system prompt)."""
    return [{"role": "user", "content": PROMPT.format(a=a, b=b)}]


def reward(reply: str, answer: int) -> float:
    """1.0 if `reply` starts with `answer`, 0.3 if it contains it as a whole number, else 0.0.

    >>> reward(" 12.", 12), reward("7 + 5 = 12", 12), reward("112", 12)
    (1.0, 0.3, 0.0)
    """
    number = rf"(?<!\d){answer}(?!\d)"
    if re.match(number, reply.strip()):
        return 1.0
    return 0.3 if re.search(number, reply) else 0.0
