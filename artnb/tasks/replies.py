"""What every task does with a model's reply: retry transient API failures, and read a JSON object leniently.

Tasks constrain their moves on our engines, but also run against hosted models without constraints, where a
reply may wrap its JSON in prose or code fences.
"""

from __future__ import annotations

import json

import openai

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
