"""Per-token rows of a trainable turn: the sampled token, its sampling logprob and the alternatives.

This is what the token view of `GroupView` shows: low-probability tokens are where the model was unsure,
which is where GRPO's advantage moves the policy most. A turn is either a live `Choice` (logprobs as the
engine returned them) or a logged message dict read back from disk (`{"trainable": True, "logprobs": [...]}`,
see `Trajectory.for_logging`), so the view works for a running loop and for a finished run alike.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from openai.types.chat.chat_completion import Choice


@dataclass(frozen=True)
class TokenRow:
    index: int  # position in the turn's generated tokens
    token: str  # the token as the engine decoded it
    logprob: float | None  # sampling logprob; None when the engine returned none for this token
    top: tuple[tuple[str, float], ...] = ()  # the engine's top alternatives (token, logprob), if asked for

    @property
    def prob(self) -> float | None:
        return None if self.logprob is None else math.exp(self.logprob)


def is_trainable_turn(item: Any) -> bool:
    """A `Choice`, or a logged message dict flagged trainable."""
    return isinstance(item, Choice) or (isinstance(item, dict) and bool(item.get("trainable")))


def token_rows(turn: Choice | dict[str, Any]) -> list[TokenRow]:
    """The generated tokens of a trainable turn with their sampling logprobs; [] if none were stored."""
    if isinstance(turn, Choice):
        content = turn.logprobs.content if turn.logprobs and turn.logprobs.content else []
        return [
            TokenRow(
                index=i,
                token=t.token,
                logprob=_finite(t.logprob),
                top=tuple((a.token, a.logprob) for a in (t.top_logprobs or []) if a.token != t.token),
            )
            for i, t in enumerate(content)
        ]
    if isinstance(turn, dict):
        return [
            TokenRow(
                index=i,
                token=str(t.get("token", "")),
                logprob=_finite(t.get("logprob")),
                top=tuple(
                    (a["token"], a["logprob"])
                    for a in t.get("top_logprobs") or []
                    if a["token"] != t.get("token")
                ),
            )
            for i, t in enumerate(turn.get("logprobs") or [])
        ]
    raise TypeError(f"token_rows takes a Choice or a logged message dict, got {type(turn).__name__}")


@dataclass(frozen=True)
class TokenSummary:
    num_tokens: int
    mean_logprob: float | None  # mean over tokens with a logprob
    perplexity: float | None  # exp(-mean_logprob)
    least_likely: tuple[TokenRow, ...]  # up to 3 lowest-logprob tokens, lowest first


def summarize_tokens(rows: list[TokenRow]) -> TokenSummary:
    scored = [(r.logprob, r) for r in rows if r.logprob is not None]
    if not scored:
        return TokenSummary(len(rows), None, None, ())
    mean = statistics.fmean(logprob for logprob, _ in scored)
    lowest = tuple(r for _, r in sorted(scored, key=lambda x: x[0])[:3])
    return TokenSummary(len(rows), mean, math.exp(-mean), lowest)


def _finite(x: Any) -> float | None:
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None
