"""`art.mcp`: MCP·RL, train an agent to use an MCP server from its tool list alone.

    server = art.mcp.python_server("artnb.mcp.notes_server", "--db", ":memory:", "--seed")
    tools = await art.mcp.list_tools(*server)
    scenarios = await art.mcp.generate_scenarios(tools, num_scenarios=24, generator_model=model.as_base_model())

    async def rollout(model, scenario):
        async with art.mcp.connect(*server) as connection:   # a fresh server process (and database) per rollout
            return await art.mcp.run_agent(model, scenario.task, connection)

RULER scores each group (`art.ruler_score_group`); the rest is the usual loop, and `art.mcp.evaluate(model,
held_out, judge, server)` compares base and trained on held-out tasks. The server is a real subprocess
driven by the official `mcp` SDK (`pip install 'artnb[mcp]'`).
"""

import sys
from types import ModuleType
from typing import TYPE_CHECKING

# Each name is imported on first use (PEP 562), as `import artnb` does: a server module in this package
# (`python -m artnb.mcp.notes_server`, started once per rollout) then imports only what it needs, not the agent
# loop with pandas and the OpenAI SDK's types (2.1 s of the notes server's 3 s of imports on this CPU).
_EXPORTS: dict[str, str] = {
    "run_agent": "agent",
    **dict.fromkeys(
        ("MCPConnection", "MCPServerError", "ToolResult", "connect", "list_tools", "python_server"),
        "connection",
    ),
    "evaluate": "evaluate",
    **dict.fromkeys(("describe_server", "generate_scenarios", "preview_scenarios"), "generate_scenarios"),
    **dict.fromkeys(("GeneratedScenario", "GeneratedScenarioCollection", "MCPResource", "MCPTool"), "types"),
}

if TYPE_CHECKING:  # what type checkers and editors see
    from .agent import run_agent
    from .connection import MCPConnection, MCPServerError, ToolResult, connect, list_tools, python_server
    from .evaluate import evaluate
    from .generate_scenarios import describe_server, generate_scenarios, preview_scenarios
    from .types import GeneratedScenario, GeneratedScenarioCollection, MCPResource, MCPTool

__all__ = [
    "GeneratedScenario",
    "GeneratedScenarioCollection",
    "MCPConnection",
    "MCPResource",
    "MCPServerError",
    "MCPTool",
    "ToolResult",
    "connect",
    "describe_server",
    "evaluate",
    "generate_scenarios",
    "list_tools",
    "preview_scenarios",
    "python_server",
    "run_agent",
]


def __getattr__(name: str):
    import importlib
    import importlib.util

    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    elif importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f".{name}", __name__)  # a submodule: art.mcp.agent.SYSTEM
    else:
        raise AttributeError(f"module 'artnb.mcp' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


class _Package(ModuleType):
    """`evaluate` and `generate_scenarios` name a function and its module. Importing the module binds it on
    the package (Python does that for every submodule on its first import), which would hide the function;
    the function keeps the name."""

    def __setattr__(self, name: str, value: object) -> None:
        if isinstance(value, ModuleType) and name in ("evaluate", "generate_scenarios"):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
