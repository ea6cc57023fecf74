"""Scenarios for MCP·RL: tasks a user might give an agent of an MCP server, written by a generator model from the
server's tool list alone.

This is AutoRL's generator (artnb/autorl.py: batched requests, deduplication, JSON enforced while decoding on
artnb's engines) given a task description made from the tools; ART's call shape (`generate_scenarios(tools,
num_scenarios=..., generator_model=...)`) is kept. Unlike ART, the generator may be an `art.Model`, e.g.
`model.as_base_model()`, so scenarios can be made offline with the model you train; and a hosted generator
without its key is an error before any request, naming the ways out.

Where a hosted generator is asked follows ART: `generator_model` is a model id at an OpenAI-compatible endpoint,
`generator_base_url`, which is OpenRouter when left out and a key for it is at hand (`generator_api_key` or
OPENROUTER_API_KEY), as in ART's MCP·RL notebook. With no such key, the model string is litellm's (its provider's
key from the environment, e.g. OPENAI_API_KEY for `openai/...`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

from ..core.model import Model
from .types import GeneratedScenario, GeneratedScenarioCollection, MCPResource, MCPTool

ART_DEFAULT_GENERATOR = "openai/gpt-4.1-mini"
OPENROUTER_BASE_URL = "https://openrouter.ai/api/v1"


def describe_server(
    tools: Sequence[MCPTool], resources: Sequence[MCPResource] = (), custom_instructions: str | None = None
) -> str:
    """The task description the generator reads: what the server offers and what a scenario should be."""
    lines = ["An AI agent helps a user through an MCP server that offers these tools:"]
    for tool in tools:
        params = ", ".join((tool.parameters or {}).get("properties", {}))
        lines.append(f"- {tool.name}({params}): {tool.description or 'no description'}")
    if resources:
        lines.append("and these resources:")
        lines += [f"- {r.uri}: {r.description or r.name}" for r in resources]
    lines.append(
        "A scenario is one request a user sends the agent: a realistic task the tools can accomplish, from a "
        "single lookup (difficulty 1) to several steps (difficulty 5), without naming the tools to use."
    )
    if custom_instructions:
        lines.append(custom_instructions.strip())
    return "\n".join(lines)


async def generate_scenarios(
    tools: Iterable[MCPTool | dict[str, Any]],
    resources: Iterable[MCPResource | dict[str, Any]] | None = None,
    num_scenarios: int = 24,
    show_preview: bool = True,
    custom_instructions: str | None = None,
    generator_model: str | Model = ART_DEFAULT_GENERATOR,
    generator_api_key: str | None = None,
    generator_base_url: str | None = None,
    **options: Any,
) -> GeneratedScenarioCollection:
    """`num_scenarios` distinct tasks for an agent of the server whose `tools` (and `resources`) are given.

    generator_model: a hosted model (see the module docstring for where it is asked) or an `art.Model`
        (offline: `model.as_base_model()`). `options` go to `art.autorl.generate_scenarios` (batch_size,
        concurrency, seed, examples, max_task_chars, allow_fewer...).
    """
    from ..autorl import generate_scenarios as generate

    tool_list = [t if isinstance(t, MCPTool) else MCPTool.from_dict(t) for t in tools]
    resource_list = [r if isinstance(r, MCPResource) else MCPResource.from_dict(r) for r in resources or []]
    if not tool_list and not resource_list:
        raise ValueError(
            "no tools and no resources: list the server's tools first, e.g. await art.mcp.list_tools(...)"
        )
    extra = dict(options.pop("extra_litellm_params", None) or {})
    if isinstance(generator_model, str):
        generator_model, endpoint = hosted_generator(generator_model, generator_api_key, generator_base_url)
        extra = {**endpoint, **extra}
    made = await generate(
        describe_server(tool_list, resource_list, custom_instructions),
        num_scenarios,
        model=generator_model,
        extra_litellm_params=extra or None,
        **options,
    )
    collection = GeneratedScenarioCollection(
        GeneratedScenario(task=s.task, difficulty=s.difficulty) for s in made
    )
    if show_preview:
        print(made.summary())
        collection.preview()
    return collection


def hosted_generator(model: str, api_key: str | None, base_url: str | None) -> tuple[str, dict[str, str]]:
    """The litellm model string and endpoint settings that ask `model` where ART would (module docstring)."""
    key = api_key or os.environ.get("OPENROUTER_API_KEY")
    if base_url or key:
        # litellm's `openai/` prefix: an OpenAI-compatible server at api_base, sent the model id unchanged
        endpoint = {"api_base": base_url or OPENROUTER_BASE_URL}
        return f"openai/{model}", {**endpoint, **({"api_key": key} if key else {})}
    if model == ART_DEFAULT_GENERATOR and not os.environ.get("OPENAI_API_KEY"):
        raise ValueError(
            f"generator_model={model!r} needs a key: generator_api_key=... or OPENROUTER_API_KEY (asked at "
            f"OpenRouter, as in ART), or OPENAI_API_KEY (asked at OpenAI); to generate offline pass "
            "generator_model=model.as_base_model()"
        )
    return model, {}


def preview_scenarios(scenarios: Iterable[GeneratedScenario | dict[str, Any]], n: int = 5) -> None:
    """Print the first `n` scenarios."""
    GeneratedScenarioCollection(
        s if isinstance(s, GeneratedScenario) else GeneratedScenario.from_dict(s) for s in scenarios
    ).preview(n)
