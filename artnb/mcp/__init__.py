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

from .agent import run_agent
from .connection import MCPConnection, MCPServerError, ToolResult, connect, list_tools, python_server
from .evaluate import evaluate
from .generate_scenarios import (  # rebinds the name: the function
    describe_server,
    generate_scenarios,
    preview_scenarios,
)
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
