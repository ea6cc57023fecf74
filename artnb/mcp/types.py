"""What MCP·RL passes around: an MCP server's tools and resources, and the scenarios generated for them.

The names and fields follow ART's `art.mcp.types` so its notebooks run with the import renamed; the classes are
pydantic models, so bad input fails when it is made (a difficulty of 7, a task that is empty), not later.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator


class MCPTool(BaseModel):
    """A tool as the MCP server lists it; `to_openai()` is the same tool in a chat request's `tools`."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MCPTool:
        return cls(
            name=data.get("name", ""),
            description=data.get("description") or "",
            parameters=data.get("parameters") or data.get("inputSchema") or data.get("input_schema") or {},
        )

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()

    def to_openai(self) -> dict[str, Any]:
        return {"type": "function", "function": self.model_dump()}


class MCPResource(BaseModel):
    """A resource as the MCP server lists it."""

    model_config = ConfigDict(populate_by_name=True)
    uri: str
    name: str = ""
    description: str = ""
    mime_type: str | None = Field(None, alias="mimeType")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MCPResource:
        return cls.model_validate(data)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class GeneratedScenario(BaseModel):
    """A task a user might give an agent of this server, and how hard it is (1 easy to 5 hard)."""

    task: str = Field(min_length=1)
    difficulty: int = Field(ge=1, le=5)

    @field_validator("task", mode="before")
    @classmethod
    def _strip(cls, value: Any) -> Any:
        return value.strip() if isinstance(value, str) else value

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GeneratedScenario:
        return cls.model_validate(data)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()

    def preview(self, max_length: int = 120) -> str:
        return self.task if len(self.task) <= max_length else self.task[:max_length].rstrip() + "…"


class GeneratedScenarioCollection:
    """Scenarios in order, with the helpers a training script needs (split, shuffle, filter, summaries)."""

    def __init__(self, scenarios: Iterable[GeneratedScenario]) -> None:
        self.scenarios = list(scenarios)

    @classmethod
    def from_dicts(cls, data: Iterable[dict[str, Any]]) -> GeneratedScenarioCollection:
        return cls(GeneratedScenario.from_dict(d) for d in data)

    def to_dicts(self) -> list[dict[str, Any]]:
        return [s.to_dict() for s in self.scenarios]

    def __len__(self) -> int:
        return len(self.scenarios)

    def __iter__(self) -> Iterator[GeneratedScenario]:
        return iter(self.scenarios)

    def __getitem__(self, index: Any) -> Any:
        picked = self.scenarios[index]
        return GeneratedScenarioCollection(picked) if isinstance(index, slice) else picked

    def shuffle(self, seed: int | None = None) -> GeneratedScenarioCollection:
        """A shuffled copy (`seed` makes it repeatable; the global `random` is left alone)."""
        shuffled = list(self.scenarios)
        random.Random(seed).shuffle(shuffled)
        return GeneratedScenarioCollection(shuffled)

    def split(self, train_size: int) -> tuple[GeneratedScenarioCollection, GeneratedScenarioCollection]:
        """The first `train_size` scenarios and the rest (held out)."""
        if not 0 <= train_size <= len(self):
            raise ValueError(
                f"train_size={train_size}: choose from 0 to {len(self)} (the number of scenarios)"
            )
        return self[:train_size], self[train_size:]

    def filter_by_difficulty(
        self, min_difficulty: int = 1, max_difficulty: int = 5
    ) -> GeneratedScenarioCollection:
        return GeneratedScenarioCollection(
            s for s in self.scenarios if min_difficulty <= s.difficulty <= max_difficulty
        )

    def get_difficulty_distribution(self) -> Counter:
        return Counter(s.difficulty for s in self.scenarios)

    def get_summary(self) -> dict[str, Any]:
        n = len(self) or 1
        return {
            "total_scenarios": len(self),
            "difficulty_distribution": dict(self.get_difficulty_distribution()),
            "avg_difficulty": sum(s.difficulty for s in self.scenarios) / n,
            "avg_task_length": sum(len(s.task) for s in self.scenarios) / n,
        }

    def preview(self, n: int = 5, max_task_length: int = 120) -> None:
        """Print the first `n` scenarios (in a notebook, `art.widgets.ScenarioEditor` shows them all)."""
        for i, s in enumerate(self.scenarios[:n], 1):
            print(f"{i:3d}. {s.preview(max_task_length)}  (difficulty {s.difficulty}/5)")

    def print_difficulty_distribution(self) -> None:
        counts = self.get_difficulty_distribution()
        for d in range(1, 6):
            print(f"  {d}/5: {counts.get(d, 0):3d}  {'█' * min(counts.get(d, 0), 30)}")

    def __repr__(self) -> str:
        return f"GeneratedScenarioCollection({len(self)} scenarios)"
