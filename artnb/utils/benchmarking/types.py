"""`BenchmarkModelKey`: which model and split a benchmark chart draws, and the name its legend shows.

Same constructor as OpenPipe ART's `art.utils.benchmarking.types.BenchmarkModelKey(name, display_name=None,
split="val")`; here a frozen dataclass, so keys compare equal by value and can sit in sets.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BenchmarkModelKey:
    """`BenchmarkModelKey("agent-001", "Qwen3 + RL", "val")`: rows of model "agent-001" on split "val",
    labelled "Qwen3 + RL"."""

    name: str  # the model's name, the `model` column of load_trajectories' table
    display_name: str | None = None  # legend label; None means the name
    split: str = "val"  # the split whose rows are drawn

    def __post_init__(self) -> None:
        if not self.display_name:
            object.__setattr__(self, "display_name", self.name)

    def __str__(self) -> str:
        return self.display_name or self.name
