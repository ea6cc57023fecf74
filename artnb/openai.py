"""`artnb.openai`: ART's module path for its OpenAI helpers, so `from art.openai import ...` runs renamed."""

from .core.streams import accumulate_chunks, consume_chat_completion_stream

__all__ = ["accumulate_chunks", "consume_chat_completion_stream"]
