"""`art.guided_completion.get_guided_completion_params`: make a student model answer exactly as a teacher did, for
RL distillation (ART's tic-tac-toe self-play example): the teacher's text becomes a one-choice `guided_choice`,
its tool call a forced `tool_choice` whose tool admits only the teacher's arguments. Both engines honour these
(the HF engine's constraints, vLLM's structured outputs), so the student's logprobs for the teacher's answer come
back with the completion."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from typing import Any

from openai.types.chat import ChatCompletion


def get_guided_completion_params(
    completion: ChatCompletion, base_tools: Iterable[dict[str, Any]] | None = None
) -> tuple[list[str] | None, dict[str, Any] | None, list[dict[str, Any]] | None]:
    """(guided_choice, tool_choice, tools) that make a request reproduce `completion`'s first choice: for a tool
    call, `tool_choice` names the tool and `tools` holds it with a schema that admits only the call's arguments
    (`base_tools`: the tools the teacher had); for text, `guided_choice` is the text alone. Pass them as
    `tools=..., tool_choice=...` or `extra_body={"guided_choice": ...}`. Only the first tool call is reproduced.
    """
    message = completion.choices[0].message
    if not message.tool_calls:
        return [message.content or ""], None, None
    call = message.tool_calls[0]
    function = getattr(call, "function", None)  # a custom (non-function) tool call has none
    if function is None:
        raise ValueError(f"the teacher's tool call {call.id} is not a function call: it cannot be reproduced")
    tools = list(base_tools or [])
    tool = next((t for t in tools if t.get("function", {}).get("name") == function.name), None)
    if tool is None:
        names = [t.get("function", {}).get("name") for t in tools]
        raise ValueError(
            f"the teacher called {function.name!r}, which base_tools does not hold ({names}): pass the tools the "
            "teacher was given"
        )
    try:
        arguments = json.loads(function.arguments)
    except json.JSONDecodeError as error:
        raise ValueError(f"the teacher's arguments for {function.name!r} are not JSON: {error}") from None
    if not isinstance(arguments, dict):
        raise ValueError(
            f"the teacher's arguments for {function.name!r} are not a JSON object: {arguments!r}"
        )
    frozen = copy.deepcopy(tool)
    frozen["function"]["parameters"] = {
        "type": "object",
        "properties": {name: {"enum": [value]} for name, value in arguments.items()},
        "required": list(arguments),
        "additionalProperties": False,
    }
    return None, {"type": "function", "function": {"name": function.name}}, [frozen]
