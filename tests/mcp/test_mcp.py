"""MCP·RL against a real MCP server subprocess (the project's notes server, built on the official SDK)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import pytest
from served import served_model

import artnb as art
from artnb import models
from artnb.mcp.generate_scenarios import OPENROUTER_BASE_URL, hosted_generator

NOTES = "artnb.mcp.notes_server"
SEARCH = {
    "type": "function",
    "function": {"name": "search_notes"},
}  # one bounded call per turn: quick to decode


def server(tmp_path, name: str = "notes.db", *extra: str) -> tuple[str, list[str]]:
    return art.mcp.python_server(NOTES, "--db", str(tmp_path / name), "--seed", *extra)


@pytest.fixture(scope="module")
async def policy(tmp_path_factory):
    """The embedded model on the HF engine, as an art.Model (it writes sensible tool arguments)."""
    async with served_model(str(models.embedded_model_path()), tmp_path_factory.mktemp("logs")) as model:
        yield model


async def test_tools_calls_and_tool_errors(tmp_path):
    async with art.mcp.connect(*server(tmp_path)) as notes:
        assert [t.name for t in notes.tools] == ["add_note", "search_notes", "list_notes", "delete_note"]
        add = notes.openai_tools()[0]["function"]
        assert add["parameters"]["required"] == ["title", "body"]
        found = await notes.call_tool("search_notes", {"query": "MILK"})
        assert not found.is_error and "Groceries" in found.text
        assert (
            await notes.call_tool("add_note", {"title": "Keys", "body": "under the mat"})
        ).text == "saved note #6"
        missing = await notes.call_tool("delete_note", {"note_id": 99})
        assert missing.is_error and "there is no note #99" in missing.text
        bad = await notes.call_tool("add_note", {"title": 5})
        assert bad.is_error and "body" in bad.text, "argument validation reaches the agent as a tool error"
        unknown = await notes.call_tool("drop_table", {})
        assert unknown.is_error and "the tools are: add_note" in unknown.text
    with pytest.raises(art.mcp.MCPServerError, match="could not start"):
        async with art.mcp.connect("/nonexistent/server"):
            pass


async def test_an_agent_rollout_keeps_calls_results_and_sampled_turns(policy, tmp_path):
    async with art.mcp.connect(*server(tmp_path)) as notes:
        trajectory = await art.mcp.run_agent(
            policy,
            "What do I need to buy at the shop?",
            notes,
            max_turns=2,
            max_tokens=100,
            tool_choice=SEARCH,
            temperature=0,
        )
    assert trajectory.metrics["tool_calls"] == 2 and trajectory.metrics["ran_out_of_turns"] == 1
    roles = [m["role"] for m in trajectory.messages()]
    assert (
        roles[:3] == ["system", "user", "assistant"]
        and roles.count("tool") == trajectory.metrics["tool_calls"]
    )
    assert trajectory.trainable_turns() == 2 and trajectory.tools[0]["function"]["name"] == "add_note"
    tool_messages = [m for m in trajectory.messages() if m["role"] == "tool"]
    assert all(m["content"] for m in tool_messages), "every call got the server's answer"


async def test_a_server_that_dies_ends_its_trajectory_and_the_gather_goes_on(policy, tmp_path):
    async def rollout(kill: bool) -> art.Trajectory:
        name = "dies" if kill else "lives"
        command, args = server(tmp_path, f"{name}.db", "--pid-file", str(tmp_path / f"{name}.pid"))
        async with art.mcp.connect(command, args) as notes:
            if kill:
                os.kill(int((tmp_path / "dies.pid").read_text()), signal.SIGKILL)
                await asyncio.sleep(0.5)
            trajectory = await art.mcp.run_agent(
                policy,
                "List my notes.",
                notes,
                max_turns=1,
                max_tokens=100,
                tool_choice=SEARCH,
                temperature=0,
            )
        trajectory.metadata["server"] = name
        return trajectory

    groups = await art.gather_trajectory_groups(
        [art.TrajectoryGroup([rollout(True), rollout(False)])], pbar_desc=None
    )
    died, lived = sorted(groups[0].trajectories, key=lambda t: t.metadata["server"] != "dies")
    assert (
        died.metrics["server_died"] == 1 and "stopped answering during tools/call" in died.metadata["error"]
    )
    assert "notes_server" in died.logs[0]
    assert "server_died" not in lived.metrics and lived.metrics["tool_calls"] >= 1


async def test_scenarios_from_the_tool_list_offline(policy, tmp_path, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    tools = await art.mcp.list_tools(*server(tmp_path))
    assert "search_notes(query)" in art.mcp.describe_server(tools)
    scenarios = await art.mcp.generate_scenarios(
        tools, num_scenarios=3, generator_model=policy, show_preview=False, batch_size=3, max_task_chars=80
    )
    assert len(scenarios) == 3 and all(1 <= s.difficulty <= 5 and 8 <= len(s.task) <= 80 for s in scenarios)
    train, held_out = scenarios.split(2)
    assert (len(train), len(held_out)) == (2, 1)
    with pytest.raises(ValueError, match="OPENROUTER_API_KEY.*as_base_model"):
        await art.mcp.generate_scenarios(tools, num_scenarios=2)
    with pytest.raises(ValueError, match="list the server's tools"):
        await art.mcp.generate_scenarios([], num_scenarios=2)
    assert sys.executable == art.mcp.python_server(NOTES)[0]


async def test_a_hosted_generator_is_asked_where_art_asks_it(scripted, monkeypatch):
    """ART's MCP·RL notebook passes an OpenRouter key and an OpenRouter model id, and leaves the endpoint to
    the default: the request must reach that endpoint with the id unchanged and the key."""
    tasks = [
        "Find my note about the dentist.",
        "List every note tagged work.",
        "Summarise last week's notes.",
    ]
    hosted = scripted([json.dumps({"scenarios": [{"task": t, "difficulty": 2} for t in tasks]})])
    tool = {
        "name": "search_notes",
        "description": "search notes",
        "parameters": {"properties": {"query": {}}},
    }
    scenarios = await art.mcp.generate_scenarios(
        [tool],
        num_scenarios=3,
        generator_model="openai/o4-mini",
        generator_api_key="sk-or-test",
        generator_base_url=hosted.base_url,
        show_preview=False,
    )
    assert [s.task for s in scenarios] == tasks
    assert hosted.requests[0]["model"] == "openai/o4-mini"
    assert hosted.headers[0]["authorization"] == "Bearer sk-or-test"

    monkeypatch.setenv("OPENROUTER_API_KEY", "sk-or-env")
    model, endpoint = hosted_generator("openai/o4-mini", None, None)
    assert (model, endpoint) == (
        "openai/openai/o4-mini",
        {"api_base": OPENROUTER_BASE_URL, "api_key": "sk-or-env"},
    )
    monkeypatch.delenv("OPENROUTER_API_KEY")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai")  # no OpenRouter key: litellm's own routing, as before
    assert hosted_generator("openai/gpt-4.1-mini", None, None) == ("openai/gpt-4.1-mini", {})
