"""An offline RULER judge that reads token probabilities instead of a written list: `art.LocalJudge`.

Why: asked to write one JSON list of scores for a whole group, the embedded 135M model writes valid numbers (the
schema makes sure of that) that carry no signal about the attempts. A small model does better at one short
question with a one-token answer, and its probabilities over the possible answers say more than the one token
it would sample. So this judge asks one question per attempt (or per pair of attempts) and reads the answer off
the next-token distribution of a single forward pass: no generation, no parsing, nothing random.

Design choices:
- `method="digits"` (default): each distinct attempt is shown alone, after the task (the messages every
  attempt starts with, shown once) and the rubric, with "Grade the attempt from 0 to 9"; its score is the
  expected digit, sum of p(d) * d over the ten digit tokens (renormalised over the digits). One forward pass
  per attempt; the shared part of the prompt (system, rubric, task) is run once and its KV cache reused.
- `method="pairwise"`: every pair of distinct attempts is shown side by side, "Which attempt is better, A or
  B?", each pair once, the order alternating so that position bias cancels over the group; an attempt's score
  is its mean probability of being preferred. n(n-1)/2 forward passes: slower, for groups of at most ~8.
- Attempts are rendered as plain "user:" / "agent:" lines (tool calls as `call name(args)`), which a small
  model follows better than JSON, latest message first: the end holds the outcome (the final answer, the
  last tool result, the last board), and a small model attends most to what it reads first. On recorded
  tic-tac-toe groups this order took the mean Spearman with the game's reward from about 0.1 to 0.4
  (benchmarks/judge_quality.py). An attempt longer than `max_attempt_tokens` keeps its latest messages.
- Within a group the expected scores are stretched to [0, 1] (lowest 0, highest 1): GRPO uses only the
  differences, and a small model's raw scores crowd into a narrow band. A single attempt, or a group whose
  attempts all get the same score, keeps its absolute score (expected digit / 9).
- In process with transformers, not through an engine: a forward pass needs no server and no sampling. The
  model is loaded once per process; forward passes run on a worker thread, one at a time, so the event loop
  (and the engine serving rollouts) keeps going.
- What it cannot do: a small judge does not solve the task it grades. It sees outcomes that are written in
  the conversation (an error, a tool result, a stated win), not ones that need the task solved (whether a
  puzzle answer is right, whether a move was legal on the board). See benchmarks/judge_quality.py.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .core.trajectory import Message, shared_prefix
from .models import DEFAULT, MODEL_BUILD_LOCK

_DIGITS = [str(d) for d in range(10)]

_SYSTEM = """\
You are a strict grader. You read a task and an attempt at it by an AI agent, and you grade the attempt.

Grading standards:
{rubric}"""

_DIGITS_QUESTION = "Grade the attempt from 0 (fails completely) to 9 (perfect). Reply with one digit."
_PAIR_QUESTION = "Which attempt is better, A or B? Reply with one letter."

_lock = threading.Lock()  # one forward pass at a time: the judge shares the CPU with everything else


@dataclass(frozen=True)
class LocalJudge:
    """A judge that runs in this process and scores from token probabilities; pass it where RULER takes a judge.

    Example, with the embedded model and no API key:
        group = await art.ruler_score_group(group, art.LocalJudge())
    """

    base_model: str = DEFAULT  # any base model artnb loads: the embedded one, a local directory, a hub id
    method: Literal["digits", "pairwise"] = "digits"  # see the module docstring; "digits" is faster
    max_attempt_tokens: int = 256  # longer attempts keep their latest messages, which hold the outcome
    max_context_tokens: int = 768  # longer task context is cut from the start too
    batch_size: int = 8  # prompts per forward pass; lower it to save memory on long prompts

    def __post_init__(self) -> None:
        if self.method not in ("digits", "pairwise"):
            raise ValueError(f"LocalJudge method must be 'digits' or 'pairwise', got {self.method!r}")

    @property
    def label(self) -> str:
        """How reports and panels name this judge: the call that makes it, e.g. "art.LocalJudge(method='digits')"."""
        model = "" if self.base_model == DEFAULT else f"base_model={self.base_model!r}, "
        return f"art.LocalJudge({model}method={self.method!r})"

    async def score(
        self, distinct: Sequence[Sequence[Message]], rubric: str, tools: list[dict[str, Any]] | None = None
    ) -> list[tuple[float, str]]:
        """(score in [0, 1], explanation) for each of `distinct` conversations, in order, relative to each other."""
        return await asyncio.to_thread(self._score_blocking, [list(m) for m in distinct], rubric, tools)

    def _score_blocking(
        self, distinct: list[list[Message]], rubric: str, tools: list[dict[str, Any]] | None
    ) -> list[tuple[float, str]]:
        if not distinct:
            return []
        tokenizer, _ = _load(self.base_model)
        shared = shared_prefix(distinct) if len(distinct) > 1 else max(0, _first_reply(distinct[0]))
        context = self._cut(_render(distinct[0][:shared]), self.max_context_tokens, tokenizer, keep="end")
        if tools:
            context += "\n\nTools the agent had: " + ", ".join(_tool_names(tools))
        attempts = [
            self._cut(_render(m[shared:][::-1]), self.max_attempt_tokens, tokenizer, keep="start")
            for m in distinct
        ]
        system = _SYSTEM.format(rubric=rubric)
        if self.method == "pairwise" and len(distinct) > 1:
            return self._pairwise(system, context, attempts)
        expected = self._digits(system, context, attempts)
        spread = max(expected) - min(expected)
        return [
            (
                (e - min(expected)) / spread if spread > 1e-6 else e / 9,
                f"expected grade {e:.2f}/9 from the judge's digit probabilities",
            )
            for e in expected
        ]

    def _digits(self, system: str, context: str, attempts: list[str]) -> list[float]:
        prompts = [
            _chat(
                system,
                f"Task:\n{context}\n\nAttempt, latest message first:\n{a}\n\n{_DIGITS_QUESTION}",
                self.base_model,
            )
            for a in attempts
        ]
        tokenizer, _ = _load(self.base_model)
        ids = [tokenizer.convert_tokens_to_ids(d) for d in _DIGITS]
        logprobs = _next_token_logprobs(self.base_model, prompts, self.batch_size)
        probs = logprobs[:, ids].softmax(-1)
        return [float(sum(p * d for d, p in enumerate(row.tolist()))) for row in probs]

    def _pairwise(self, system: str, context: str, attempts: list[str]) -> list[tuple[float, str]]:
        n = len(attempts)
        pairs = [(i, j) if (i + j) % 2 else (j, i) for i in range(n) for j in range(i + 1, n)]
        prompts = [
            _chat(
                system,
                f"Task:\n{context}\n\nAttempt A, latest message first:\n{attempts[a]}\n\n"
                f"Attempt B, latest message first:\n{attempts[b]}\n\n{_PAIR_QUESTION}",
                self.base_model,
            )
            for a, b in pairs
        ]
        tokenizer, _ = _load(self.base_model)
        ids = [tokenizer.convert_tokens_to_ids(c) for c in ("A", "B")]
        logprobs = _next_token_logprobs(self.base_model, prompts, self.batch_size)
        preferred = [[] for _ in range(n)]  # probabilities of being preferred, per attempt
        for (a, b), p in zip(pairs, logprobs[:, ids].softmax(-1).tolist(), strict=True):
            preferred[a].append(p[0])
            preferred[b].append(p[1])
        wins = [sum(p) / len(p) for p in preferred]
        spread = max(wins) - min(wins)
        return [
            (
                (w - min(wins)) / spread if spread > 1e-6 else w,
                f"preferred with mean probability {w:.2f} over {n - 1} comparisons",
            )
            for w in wins
        ]

    def _cut(self, text: str, max_tokens: int, tokenizer: Any, keep: Literal["start", "end"]) -> str:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= max_tokens:
            return text
        if keep == "start":
            return tokenizer.decode(ids[:max_tokens]) + "\n[... earlier messages cut ...]"
        return "[... start cut ...]\n" + tokenizer.decode(ids[-max_tokens:])


_load_lock = threading.Lock()  # groups judged concurrently must not each load (and convert) the model


def _load(base_model: str) -> tuple[Any, Any]:
    """(tokenizer, model) in eval mode on CPU, fp32, loaded once per process."""
    with _load_lock:
        return _load_once(base_model)


@functools.lru_cache(maxsize=2)
def _load_once(base_model: str) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .models import resolve_base_model

    path = resolve_base_model(base_model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.chat_template is None:
        raise ValueError(f"{base_model} has no chat template; LocalJudge needs an instruct (chat) model")
    with MODEL_BUILD_LOCK:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return tokenizer, model


def _chat(system: str, user: str, base_model: str) -> str:
    tokenizer, _ = _load(base_model)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _next_token_logprobs(base_model: str, prompts: list[str], batch_size: int) -> Any:
    """Log-probabilities of the token after each prompt, shape (len(prompts), vocab). The token prefix all
    prompts share is run once and its KV cache reused for every prompt."""
    import torch

    tokenizer, model = _load(base_model)
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    common = min(len(e) for e in encoded) - 1  # every prompt keeps at least one token of its own
    for k in range(common):
        if any(e[k] != encoded[0][k] for e in encoded[1:]):
            common = k
            break
    rows = []
    with _lock, torch.inference_mode():
        prefix_cache = None
        if common:
            prefix_cache = model(torch.tensor([encoded[0][:common]]), use_cache=True).past_key_values
        for start in range(0, len(encoded), batch_size):
            chunk = [e[common:] for e in encoded[start : start + batch_size]]
            width = max(len(c) for c in chunk)
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
            input_ids = torch.tensor([c + [pad] * (width - len(c)) for c in chunk])  # right padding
            mask = torch.tensor([[1] * (common + len(c)) + [0] * (width - len(c)) for c in chunk])
            cache = None
            if prefix_cache is not None:
                cache = copy.deepcopy(prefix_cache)
                cache.batch_repeat_interleave(len(chunk))
            logits = model(input_ids=input_ids, attention_mask=mask, past_key_values=cache).logits
            last = torch.tensor([len(c) - 1 for c in chunk])
            rows.append(logits[torch.arange(len(chunk)), last].float().log_softmax(-1))
    return torch.cat(rows)


def _first_reply(messages: list[Message]) -> int:
    """Index of the first assistant message: what comes before it is the task."""
    return next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))


def _render(messages: Sequence[Message]) -> str:
    """Plain 'role: content' lines; tool calls as `call name(arguments)`."""
    lines = []
    for m in messages:
        role = m.get("role", "?")
        content = m.get("content")
        if isinstance(content, list):  # content parts
            content = " ".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
        text = str(content or "").strip()
        calls = [
            f"call {c.get('function', {}).get('name', '?')}({c.get('function', {}).get('arguments', '')})"
            for c in m.get("tool_calls") or []
        ]
        lines.append(f"{'agent' if role == 'assistant' else role}: " + "\n".join([text, *calls]).strip())
    return "\n".join(lines)


def _tool_names(tools: list[dict[str, Any]]) -> list[str]:
    return [str(t.get("function", {}).get("name", json.dumps(t)[:40])) for t in tools]
