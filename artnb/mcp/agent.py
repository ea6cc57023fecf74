"""The MCP·RL rollout: the policy works on one task with an MCP server's tools until it answers.

Each turn is one chat completion with the server's tools; every tool call the model makes is run on the server
and its result goes back as a `tool` message, until the model replies without a call (its answer) or runs out of
turns. The trajectory keeps every turn as sampled (trainable) and every tool result as context; its reward stays
0 for RULER to score the group. A tool that fails is the agent's problem (the error text is its tool result, as
with any server); a server that dies ends this trajectory with the error in its logs and metadata, so the rest of
the gather goes on and the failure is visible in the group.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, cast

from ..core.model import Model
from ..core.trajectory import Trajectory
from .connection import MCPConnection, MCPServerError

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletion, ChatCompletionMessageParam, ChatCompletionToolParam

SYSTEM = (
    "You complete the user's task with the tools you are given. Call tools as needed, one step at a time; when "
    "the task is done, reply with a short summary of what you did and found, without calling a tool."
)


async def run_agent(
    model: Model,
    task: str,
    server: MCPConnection,
    *,
    max_turns: int = 6,
    max_tokens: int = 256,
    temperature: float = 1.0,
    step: int | None = None,
    system_prompt: str = SYSTEM,
    tool_choice: str | dict[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
) -> Trajectory:
    """One rollout of `task` against an open server connection (`async with art.mcp.connect(...)`).

    tool_choice: sent with every turn when given ("required" makes each turn a call, e.g. for a model that has
    not learnt to call tools yet; the rollout then ends after `max_turns`). parallel_tool_calls=False: at most
    one call per turn (sent when given).
    """
    if max_turns < 1:
        raise ValueError(f"max_turns={max_turns}: allow the agent at least one turn")
    tools = server.openai_tools()
    trajectory = Trajectory(
        messages_and_choices=[
            {"role": "system", "content": system_prompt},
            {"role": "user", "content": task},
        ],
        tools=tools,
        metadata={"task": task},
    )
    options: dict[str, Any] = {}  # sent only when given
    if tool_choice is not None:
        options["tool_choice"] = tool_choice
    if parallel_tool_calls is not None:
        options["parallel_tool_calls"] = parallel_tool_calls
    calls = errors = 0
    for _ in range(max_turns):
        completion: ChatCompletion = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(step),
            # Trajectory keeps messages and tools as plain chat-format dicts; the SDK types them as TypedDicts
            messages=cast("list[ChatCompletionMessageParam]", trajectory.messages()),
            tools=cast("list[ChatCompletionToolParam]", tools),
            max_tokens=max_tokens,
            temperature=temperature,
            **options,
        )
        choice = completion.choices[0]
        trajectory.messages_and_choices.append(choice)
        if not choice.message.tool_calls:
            break
        try:
            for call in choice.message.tool_calls:
                calls += 1
                if call.type == "function":
                    result = await _run_call(server, call.function.name, call.function.arguments)
                else:  # a custom (free-text) tool call: the server's tools are all functions
                    result = f"unsupported tool call type {call.type!r}: call the tools as functions", 1
                errors += result[1]
                trajectory.messages_and_choices.append(
                    {"role": "tool", "tool_call_id": call.id, "content": result[0]}
                )
        except MCPServerError as error:
            trajectory.log(str(error))
            trajectory.metadata["error"] = str(error).splitlines()[0]
            trajectory.metrics["server_died"] = 1
            break
    else:
        trajectory.metrics["ran_out_of_turns"] = 1
    trajectory.metrics.update(tool_calls=calls, tool_errors=errors)
    return trajectory.finish()


async def _run_call(server: MCPConnection, name: str, arguments: str | None) -> tuple[str, int]:
    """(the tool message's text, 1 if it is an error else 0)."""
    try:
        parsed: Any = json.loads(arguments or "{}")
    except ValueError as error:
        return f"the arguments are not JSON ({error}): {arguments!r}", 1
    if not isinstance(parsed, dict):
        return f"the arguments must be a JSON object, got {arguments!r}", 1
    result = await server.call_tool(name, parsed)
    return result.text, int(result.is_error)
