"""What every task does to get a move from a model and read it: ask (constrained to the legal choices on our
engines, free for a hosted model), retry transient API failures, and read the reply leniently.

Tasks constrain their moves on our engines, but also run against hosted models without constraints, where a
reply may say "B2." or wrap its JSON in prose or code fences.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, cast

import openai
from openai.types.chat.chat_completion import Choice

from ..core.gather import retry
from ..core.model import Model

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

# Failures worth another try (`art.retry(exceptions=TRANSIENT_ERRORS)`); a 4xx is the request's fault and is not.
TRANSIENT_ERRORS = (openai.APIConnectionError, openai.RateLimitError, openai.InternalServerError)


def json_object(text: str | None) -> dict | None:
    """The JSON object in a reply (allowing text or code fences around it), or None."""
    text = text or ""
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        return None
    try:
        data = json.loads(text[start : end + 1])
    except json.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


@retry(exceptions=TRANSIENT_ERRORS)
async def ask_choice(
    model: Model,
    messages: list[dict[str, Any]],
    choices: list[str],
    *,
    step: int | None,
    temperature: float,
    constrained: bool,
    max_tokens: int,
    free_max_tokens: int,
) -> Choice:
    """One move: the reply is one of `choices` when `constrained` (`structured_outputs.choice`), else free text
    of at most `free_max_tokens`. Returns the `Choice`, a trainable turn."""
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(step),
        # plain chat-format dicts; the SDK types messages as TypedDicts
        messages=cast("list[ChatCompletionMessageParam]", messages),
        max_tokens=max_tokens if constrained else free_max_tokens,
        temperature=temperature,
        logprobs=True,
        extra_body={"structured_outputs": {"choice": choices}} if constrained else None,
    )
    return completion.choices[0]


def parse_word(text: str | None, options: list[str]) -> str | None:
    """The option a one-word reply names, ignoring case, spaces and trailing punctuation ("b2." is "B2")."""
    word = (text or "").strip().strip(".!\"'`*").strip().casefold()
    return next((option for option in options if option.casefold() == word), None)
