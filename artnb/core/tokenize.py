"""Trajectory -> token ids, trainable-token mask and sampling logprobs (the trainer's only input).

Design choices, and why:
- Generated text is never re-tokenised: a trainable turn (a `Choice`) contributes the exact ids the engine
  sampled (`choice.token_ids`, else vLLM's `"token_id:N"` logprob tokens, else - with a warning - a vocabulary
  look-up of the logprob tokens). Re-tokenising can yield different ids than were sampled, and then the
  sampling logprobs belong to other tokens; that drift is known to break RL convergence.
- The conversation is rendered by the tokenizer's own chat template, with each trainable turn's content replaced
  by a placeholder that is a single added special token (`<|artnb_turn_0|>`, ... on a cached copy of the
  tokenizer), so the placeholder cannot merge with its neighbours and every one is found exactly once. The
  template's variables (`template_kwargs`: `_internal_config["chat_template_kwargs"]`, e.g. Qwen3's
  `enable_thinking`) are the ones the engine rendered the prompts with, or the tokens trained are not the ones
  sampled from; a configured template text is set on the tokenizer itself when the model is set up.
- The end-of-turn token: when the sampled ids end with the tokens the template writes after the content (the EOS
  the model sampled), the sampled copy stays trainable (the model must learn to stop) and the template's copy is
  dropped. A turn stopped for length keeps the template's end-of-turn token as context.
- Messages after the last trainable turn are cut: nothing after it can be learned from.
- A chat template that drops `tools` or an assistant message's `tool_calls` (SmolLM2's, the embedded model's)
  is warned about, once per template and kind, and trained as it stands: the engine rendered the prompts with
  the same template, so the model never saw the tool definitions, and a turn after a tool call was sampled from
  a prompt without the call while the trained sequence keeps its sampled tokens (off-policy logprobs). Probes
  rendered with the conversation's own tokenizer and template variables tell, cached per template.
- With `allow_training_without_logprobs`, assistant dicts (and Choices without logprobs) train too: their text is
  tokenised as the template renders it, their logprobs are NaN (the loss then uses ratio 1) and the end-of-turn
  special token the template writes after them is trainable, as a sampled EOS would be.
"""

from __future__ import annotations

import copy
import math
import re
import threading
import warnings
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

from openai.types.chat.chat_completion import Choice
from transformers import AddedToken, PreTrainedTokenizerBase

from .chat_messages import template_message
from .grpo import group_advantages
from .ignored import warn_user
from .metric_names import std_of
from .trajectory import (
    History,
    Message,
    Trajectory,
    TrajectoryGroup,
    check_trajectories,
    choice_to_message,
)

NAN = float("nan")
_PLACEHOLDER = "<|artnb_turn_{}|>"
_TOKEN_ID = re.compile(r"token_id:(\d+)")
_RETOKENISE_WARNING = (
    "artnb: a trainable turn has no token ids, so they were looked up from its logprob token strings; this can "
    "drift from what was sampled. Make the engine return token ids (vLLM: return_token_ids=True or "
    "return_tokens_as_token_ids=True)."
)

_DROPPED = {
    "tools": (
        "the tool definitions (trajectory.tools)",
        "the model never saw them when it sampled, and does not see them in training",
    ),
    "tool_calls": (
        "an assistant message's tool_calls",
        "the engine dropped each tool call from the prompt it sampled the next turn from, while the trained "
        "sequence keeps the sampled call's tokens: turns after a tool call train on a context they were not "
        "sampled from (off-policy logprobs)",
    ),
}
TOOLS_FIX = (  # how to make a model see tools and its own calls
    "use a model whose chat template renders tools (e.g. a Qwen2.5, Qwen3 or Llama-3.1 instruct model), or set "
    "_internal_config={'chat_template': ...} to a template that does, or describe the tools in the system prompt "
    "and parse calls from plain content, as artnb/tasks/email_agent.py does"
)


@dataclass
class TokenizedSequence:
    """One conversation (a trajectory's main history or one of its additional histories), ready to train."""

    token_ids: list[int]
    assistant_mask: list[bool]  # True on tokens the model sampled in a trainable turn
    logprobs: list[float]  # sampling logprob on trainable tokens (NaN where unknown), NaN elsewhere
    advantage: float  # the trajectory's group advantage, shared by all its tokens
    group_index: int
    trajectory_index: int

    def num_trainable_tokens(self) -> int:
        return sum(self.assistant_mask)


@dataclass
class _Turn:
    """One trainable turn: either the sampled ids (a Choice) or a message whose rendered text is trained."""

    item: int  # position in messages_and_choices
    token_ids: list[int] | None  # None: train the template's rendering of `message`
    logprobs: list[float]
    message: Message


class _Placeholders:
    """A copy of a tokenizer with `n` single-token placeholders added, grown on demand."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.source_len = len(tokenizer)
        self.tokenizer = copy.deepcopy(tokenizer)
        self.ids: list[int] = []
        self.special = set(tokenizer.all_special_ids) | {
            i for i, t in tokenizer.added_tokens_decoder.items() if t.special
        }

    def ensure(self, n: int) -> None:
        if n <= len(self.ids):
            return
        new = [_PLACEHOLDER.format(i) for i in range(len(self.ids), max(n, 2 * len(self.ids), 8))]
        self.tokenizer.add_tokens(
            [AddedToken(t, special=True, normalized=False) for t in new], special_tokens=True
        )
        self.ids.extend(cast(list[int], self.tokenizer.convert_tokens_to_ids(new)))  # a list in, a list out


_cache: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, _Placeholders] = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


def _placeholders(tokenizer: PreTrainedTokenizerBase, n: int) -> _Placeholders:
    with _cache_lock:
        entry = _cache.get(tokenizer)
        stale = entry is not None and entry.source_len != len(tokenizer)  # tokens were added to the original
        if entry is None or stale:
            entry = _cache[tokenizer] = _Placeholders(tokenizer)
        entry.ensure(n)
        return entry


def _where(gi: int, ti: int, hi: int | None) -> str:
    """'group 1, trajectory 2' or, for an additional history, 'group 1, trajectory 2, additional_histories[0]'."""
    return f"group {gi}, trajectory {ti}" + (f", additional_histories[{hi}]" if hi is not None else "")


def _sampled_ids(choice: Choice, tokenizer: PreTrainedTokenizerBase, where: str) -> list[int] | None:
    """The engine's token ids for a Choice: `token_ids` field, else `"token_id:N"` tokens, else a vocab look-up."""
    ids = getattr(choice, "token_ids", None)
    if ids is None and choice.model_extra:
        ids = choice.model_extra.get("token_ids")
    if ids is not None:
        return [int(i) for i in ids]
    content = choice.logprobs.content if choice.logprobs else None
    if content is None:
        return None
    matches = [_TOKEN_ID.fullmatch(t.token) for t in content]
    if all(matches):
        return [int(m.group(1)) for m in matches]  # type: ignore[union-attr]
    warnings.warn(_RETOKENISE_WARNING, stacklevel=4)
    out = []
    for t in content:
        i = tokenizer.convert_tokens_to_ids(t.token)
        if i is None or (i == tokenizer.unk_token_id and t.token != tokenizer.unk_token):
            raise ValueError(
                f"{where}: logprob token {t.token!r} is not in the tokenizer's vocabulary, so its id is unknown. "
                "Make the engine return token ids (vLLM: return_token_ids=True or return_tokens_as_token_ids=True)"
            )
        out.append(i)
    return out


def trainable_turns(
    history: History, tokenizer: PreTrainedTokenizerBase, where: str, allow_training_without_logprobs: bool
) -> list[_Turn]:
    """The trainable turns of one history, validated; raises naming `where` and the fix."""
    turns = []
    for k, item in enumerate(history.messages_and_choices):
        here = f"{where}, messages_and_choices[{k}]"
        if isinstance(item, Choice):
            content = item.logprobs.content if item.logprobs else None
            if content is None and not allow_training_without_logprobs:
                raise ValueError(
                    f"{here} is a Choice without logprobs, so it cannot be trained. Request logprobs=True "
                    "(artnb's engines always return them), or pass allow_training_without_logprobs=True"
                )
            ids = _sampled_ids(item, tokenizer, here)
            if content is None:
                turns.append(_Turn(k, ids, [NAN] * len(ids or []), choice_to_message(item)))
            elif ids is not None and len(ids) == len(content):
                turns.append(_Turn(k, ids, [float(t.logprob) for t in content], choice_to_message(item)))
            else:
                raise ValueError(
                    f"{here}: the Choice has {len(ids or [])} token ids but {len(content)} logprobs; they must "
                    "describe the same sampled tokens. Pass the Choice exactly as the engine returned it"
                )
        elif allow_training_without_logprobs and item.get("role") == "assistant":
            turns.append(_Turn(k, None, [], item))
    if not turns and any(_is_assistant(item) for item in history.messages_and_choices):
        raise ValueError(
            f"{where} has no trainable turn: append completion.choices[0] (a Choice) instead of a message dict, "
            "or pass allow_training_without_logprobs=True to train assistant message dicts"
        )
    return turns


def _is_assistant(item: Any) -> bool:
    return isinstance(item, Choice) or item.get("role") == "assistant"


def _without_turns(trajectory: Trajectory) -> int:
    """How many of the trajectory's histories have no assistant turn at all (a role that never got to play)."""
    return sum(not any(map(_is_assistant, h.messages_and_choices)) for h in trajectory.histories())


def _render(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[Message],
    tools: Any,
    where: str,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The conversation as the chat template writes it, with `template_kwargs` (the model's
    `_internal_config["chat_template_kwargs"]`, which the engine rendered the prompts with) as its variables."""
    try:
        # tokenize=False returns the text (transformers types the call's every return kind)
        return cast(
            str,
            tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **(template_kwargs or {})),
        )
    except Exception as e:
        raise ValueError(
            f"{where}: the chat template could not render the conversation ({type(e).__name__}: {e}). "
            "Check the messages: each a dict with a role the template knows and text content"
        ) from e


_drops: dict[tuple[str, str], frozenset[str]] = {}
_warned_drops: set[tuple[str, str]] = set()  # (template, kind) already warned about


def _template_drops(
    tokenizer: PreTrainedTokenizerBase, template_kwargs: Mapping[str, Any] | None
) -> frozenset[str]:
    """Which of "tools" and "tool_calls" the chat template leaves out: a probe renders the same with and without
    them. A probe the template refuses to render says nothing, so it counts as rendered."""
    key = (repr(tokenizer.chat_template), repr(sorted((template_kwargs or {}).items())))
    with _cache_lock:
        if key in _drops:
            return _drops[key]
    tool = {"type": "function", "function": {"name": "artnb_probe", "parameters": {"type": "object"}}}
    call = {"id": "call00000", "type": "function", "function": {"name": "artnb_probe", "arguments": "{}"}}
    user: Message = {"role": "user", "content": "Hi"}
    probes = {
        "tools": (([user], [tool]), ([user], None)),
        "tool_calls": (
            ([user, {"role": "assistant", "content": "", "tool_calls": [call]}], None),
            ([user, {"role": "assistant", "content": ""}], None),
        ),
    }
    dropped = set()
    for kind, renders in probes.items():
        try:
            texts = [
                tokenizer.apply_chat_template(m, tools=t, tokenize=False, **(template_kwargs or {}))
                for m, t in renders
            ]
        except Exception:
            continue
        if texts[0] == texts[1]:
            dropped.add(kind)
    with _cache_lock:
        _drops[key] = frozenset(dropped)
    return _drops[key]


def _dropped_in(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    tools: Any,
    template_kwargs: Mapping[str, Any] | None,
) -> list[str]:
    """The kinds ("tools", "tool_calls") this conversation uses and its chat template drops."""
    used = {"tools"} if tools else set()
    if any(m.get("role") == "assistant" and m.get("tool_calls") for m in messages):
        used.add("tool_calls")
    if not used:
        return []
    dropped = _template_drops(tokenizer, template_kwargs)
    return [k for k in _DROPPED if k in used and k in dropped]


def _warn_if_tools_dropped(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[Message],
    tools: Any,
    template_kwargs: Mapping[str, Any] | None,
) -> None:
    """Warn, once per template and kind, when the conversation has tools or tool calls its template drops."""
    for kind in _dropped_in(tokenizer, messages, tools, template_kwargs):
        with _cache_lock:
            key = (repr(tokenizer.chat_template), kind)
            if key in _warned_drops:
                continue
            _warned_drops.add(key)
        what, meaning = _DROPPED[kind]
        warn_user(
            f"artnb: this model's chat template does not render {what}, so {meaning}. Training goes on as it "
            f"stands (ART behaves the same). To fix: {TOOLS_FIX}."
        )


def dropped_tool_parts(
    tokenizer: PreTrainedTokenizerBase,
    trajectories: Sequence[Trajectory],
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[str]:
    """What of the trajectories' tool use the chat template leaves out of every rendering (so the engine's
    prompts lacked it too): the descriptions of "tools" and/or "tool_calls", e.g. for preflight's check."""
    found: set[str] = set()
    for t in trajectories:
        for h in t.histories():
            messages = [x if isinstance(x, dict) else choice_to_message(x) for x in h.messages_and_choices]
            tools = h.tools if h.tools is not None else t.tools
            found.update(_dropped_in(tokenizer, messages, tools, template_kwargs))
    return [what for kind, (what, _) in _DROPPED.items() if kind in found]


def _overlap(sampled: list[int], following: list[int], special: set[int]) -> int:
    """How many leading template tokens after a turn repeat the sampled ids' tail (must include a special token)."""
    for k in range(min(len(sampled), len(following)), 0, -1):
        if sampled[-k:] == following[:k] and any(t in special for t in following[:k]):
            return k
    return 0


def tokenize_history(
    tokenizer: PreTrainedTokenizerBase,
    history: History,
    tools: Any,
    turns: list[_Turn],
    advantage: float,
    gi: int,
    ti: int,
    where: str,
    *,
    template_kwargs: Mapping[str, Any] | None = None,
) -> TokenizedSequence:
    """One history's tokens, trainable mask and logprobs, rendered with the template's variables
    `template_kwargs` (as the engine rendered the prompts)."""
    holders = _placeholders(tokenizer, len(turns))
    marks = [_PLACEHOLDER.format(n) for n in range(len(turns))]
    items = history.messages_and_choices[: turns[-1].item + 1]
    messages = [template_message(x) if isinstance(x, dict) else choice_to_message(x) for x in items]
    _warn_if_tools_dropped(tokenizer, messages, tools, template_kwargs)
    for n, turn in enumerate(turns):
        messages[turn.item] = {"role": "assistant", "content": marks[n]}
    text = _render(tokenizer, messages, tools, where, template_kwargs)

    ids = holders.tokenizer.encode(text, add_special_tokens=False)
    slot = {pid: n for n, pid in enumerate(holders.ids[: len(turns)])}
    found = [(pos, slot[t]) for pos, t in enumerate(ids) if t in slot]
    if [n for _, n in found] != list(range(len(turns))):
        raise ValueError(
            f"{where}: the chat template rendered the trainable turns' placeholders as {[n for _, n in found]}, "
            f"expected each of 0..{len(turns) - 1} once and in order. The template drops or reorders assistant "
            "content (or a message contains '<|artnb_turn_N|>'); this tokenizer's template cannot be trained as is"
        )

    special = holders.special
    out_ids: list[int] = []
    mask: list[bool] = []
    logprobs: list[float] = []

    def add(chunk: list[int], trainable: bool, lps: list[float] | None = None) -> None:
        out_ids.extend(chunk)
        mask.extend([trainable] * len(chunk))
        logprobs.extend(lps if lps is not None else [NAN] * len(chunk))

    prev = 0
    for (pos, n), end in zip(found, [p for p, _ in found[1:]] + [len(ids)], strict=True):
        add(ids[prev:pos], False)
        turn, following = turns[n], ids[pos + 1 : end]
        if turn.token_ids is not None:
            add(turn.token_ids, True, turn.logprobs)
            skip = _overlap(turn.token_ids, following, special)
        else:
            add(
                tokenizer.encode(
                    _rendered_body(tokenizer, messages, tools, turn, text, marks[n], where, template_kwargs),
                    add_special_tokens=False,
                ),
                True,
            )
            skip = 1 if following and following[0] in special else 0
            add(following[:skip], True)
        prev = pos + 1 + skip
    add(ids[prev:], False)
    return TokenizedSequence(out_ids, mask, logprobs, advantage, gi, ti)


def _rendered_body(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[Message],
    tools: Any,
    turn: _Turn,
    text: str,
    mark: str,
    where: str,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The text the template writes for `turn.message` (content, and tool calls if it renders them) at `mark`."""
    real = list(messages)
    real[turn.item] = turn.message
    full = _render(tokenizer, real, tools, where, template_kwargs)
    at = text.index(mark)
    before, after = text[:at], text[at + len(mark) :]
    if not (full.startswith(before) and full.endswith(after) and len(full) >= len(before) + len(after)):
        raise ValueError(
            f"{where}, messages_and_choices[{turn.item}]: the chat template renders the rest of the conversation "
            "differently depending on this assistant message, so its tokens cannot be isolated for training. "
            "Append the Choice the engine returned instead of a message dict"
        )
    return full[len(before) : len(full) - len(after)]


def tokenize_trajectory(
    tokenizer: PreTrainedTokenizerBase,
    trajectory: Trajectory,
    advantage: float,
    *,
    group_index: int = 0,
    trajectory_index: int = 0,
    allow_training_without_logprobs: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[TokenizedSequence]:
    """One TokenizedSequence for the trajectory's messages, then one per additional history, all with `advantage`.

    `template_kwargs`: the chat template's variables (the model's `_internal_config["chat_template_kwargs"]`),
    so that the conversation is rendered as the engine rendered it when sampling.

    A history with no assistant message at all (an agent that never got a turn) gives no sequence. Raises
    ValueError naming the group, trajectory and item when a history's assistant turns are message dicts (not
    trainable without `allow_training_without_logprobs`), a Choice lacks
    logprobs (unless `allow_training_without_logprobs`), or its token ids and logprobs differ in number.
    """
    out = []
    for hi, history in enumerate(trajectory.histories()):
        where = _where(group_index, trajectory_index, hi - 1 if hi else None)
        tools = history.tools if history.tools is not None else trajectory.tools
        turns = trainable_turns(history, tokenizer, where, allow_training_without_logprobs)
        if not turns:  # no assistant message at all: nothing to train, as in ART
            continue
        out.append(
            tokenize_history(
                tokenizer,
                history,
                tools,
                turns,
                advantage,
                group_index,
                trajectory_index,
                where,
                template_kwargs=template_kwargs,
            )
        )
    return out


@dataclass
class TokenizedBatch:
    """What one GRPO step trains on, with counts that explain what was skipped and why."""

    sequences: list[TokenizedSequence]
    metrics: dict[str, float] = field(default_factory=dict)
    skipped_reason: str | None = None  # a sentence saying why `sequences` is empty, None when it is not


def _validate(
    tokenizer: PreTrainedTokenizerBase,
    groups: Sequence[TrajectoryGroup],
    allow_training_without_logprobs: bool,
) -> None:
    for gi, group in enumerate(groups):
        n = len(group.trajectories)
        if n < 2 and not group.exceptions:  # a group made of one rollout: the loop is built wrong
            raise ValueError(
                f"group {gi} has {n} trajector{'y' if n == 1 else 'ies'}; GRPO needs >= 2 to compare. "
                "Run several rollouts of the same scenario per group; nothing was trained"
            )
    check_trajectories(groups)
    for gi, group in enumerate(groups):
        for ti, t in enumerate(group.trajectories):
            for hi, history in enumerate(t.histories()):
                where = _where(gi, ti, hi - 1 if hi else None)
                trainable_turns(history, tokenizer, where, allow_training_without_logprobs)


def tokenize_groups(
    tokenizer: PreTrainedTokenizerBase,
    groups: Sequence[TrajectoryGroup],
    *,
    scale_rewards: bool = True,
    allow_training_without_logprobs: bool = False,
    max_seq_length: int | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> TokenizedBatch:
    """Validate the whole batch, compute group advantages, and tokenise every trajectory that has a nonzero one.

    Raises before tokenising anything if a group has fewer than 2 trajectories and no failed rollouts (a loop
    built with one rollout per group), a reward is not finite, or a trajectory has no trainable turn. A group
    left with fewer than 2 because its other rollouts failed is left out with a warning (counted in
    `num_groups_too_small`), as ART leaves it out. A sequence longer than `max_seq_length` trains on its first
    `max_seq_length` tokens (`_first_tokens`), with a warning; one with no sampled token among them is dropped.
    `template_kwargs`: the chat template's variables, as in `tokenize_trajectory`.
    """
    _validate(tokenizer, groups, allow_training_without_logprobs)
    sequences: list[TokenizedSequence] = []
    zero = too_long = trainable_groups = without_turns = too_small = 0
    truncated: list[int] = []  # the full lengths of sequences cut to max_seq_length
    rewards: list[float] = []
    stds: list[float] = []
    for gi, group in enumerate(groups):
        if (
            len(group.trajectories) < 2
        ):  # its other rollouts failed (_validate): nothing to compare, as in ART
            too_small += 1
            warnings.warn(
                f"group {gi} has {len(group.trajectories)} finished rollout(s) ({len(group.exceptions)} failed: "
                "see group.exceptions) and was left out of this step, since GRPO compares >= 2; the other groups "
                "train. Fix the failing rollouts, or lower max_exceptions to stop at such failures",
                stacklevel=2,
            )
            continue
        group_rewards = [float(r) for r in group.rewards()]
        rewards.extend(group_rewards)
        mean = sum(group_rewards) / len(group_rewards)
        stds.append(math.sqrt(sum((r - mean) ** 2 for r in group_rewards) / len(group_rewards)))
        advantages = group_advantages(group_rewards, scale_rewards=scale_rewards)
        trainable_groups += any(a != 0 for a in advantages)
        for ti, (t, advantage) in enumerate(zip(group.trajectories, advantages, strict=True)):
            if advantage == 0:
                zero += 1
                continue
            without_turns += _without_turns(t)
            per_history = tokenize_trajectory(
                tokenizer,
                t,
                advantage,
                group_index=gi,
                trajectory_index=ti,
                allow_training_without_logprobs=allow_training_without_logprobs,
                template_kwargs=template_kwargs,
            )
            for hi, seq in enumerate(per_history):
                if max_seq_length is not None and len(seq.token_ids) > max_seq_length:
                    cut = _first_tokens(seq, max_seq_length)
                    if cut is None:
                        too_long += 1
                        warnings.warn(
                            f"{_where(gi, ti, hi - 1 if hi else None)} has {len(seq.token_ids)} tokens and no "
                            f"sampled token among its first max_seq_length={max_seq_length}; it was dropped. Raise "
                            "max_seq_length or shorten the rollout's prompt",
                            stacklevel=2,
                        )
                        continue
                    truncated.append(len(seq.token_ids))
                    seq = cut
                sequences.append(seq)

    if truncated:
        warnings.warn(
            f"{len(truncated)} sequence(s) of up to {max(truncated)} tokens were longer than max_seq_length="
            f"{max_seq_length} and train on their first {max_seq_length} tokens only (counted in "
            "data/num_truncated_too_long). Raise max_seq_length, or shorten the rollouts, to train their ends",
            stacklevel=2,
        )
    num_trajectories = len(rewards)
    metrics = {
        "num_groups": float(len(groups)),
        "num_trajectories": float(num_trajectories),
        "num_groups_trainable": float(trainable_groups),
        "num_zero_advantage_skipped": float(zero),
        "num_groups_too_small": float(too_small),
        "num_dropped_too_long": float(too_long),
        "num_truncated_too_long": float(len(truncated)),
        "num_histories_without_turns": float(without_turns),
        "num_sequences": float(len(sequences)),
        "num_trainable_tokens": float(sum(s.num_trainable_tokens() for s in sequences)),
        "num_tokens": float(sum(len(s.token_ids) for s in sequences)),
        "reward": sum(rewards) / num_trajectories if rewards else NAN,
        std_of("reward"): sum(stds) / len(stds) if stds else NAN,
    }
    return TokenizedBatch(
        sequences,
        metrics,
        None
        if sequences
        else _skipped_reason(len(groups), zero, too_long, without_turns, len(rewards) - zero, too_small),
    )


def _first_tokens(seq: TokenizedSequence, n: int) -> TokenizedSequence | None:
    """`seq` cut to its first `n` tokens, or None when no trainable token is left among them.

    ART's LocalBackend drops a sequence longer than the trainer's limit, after the group's advantages were
    computed with it: where the long rollouts were the group's successes (an agent that solved the task in
    more turns), the step then trained only the failures' negative advantages. Cut, the long rollout keeps its
    advantage on the turns that fit, as ART's own packing does when asked to truncate."""
    if not any(seq.assistant_mask[1:n]):  # the first token is never predicted
        return None
    return replace(
        seq, token_ids=seq.token_ids[:n], assistant_mask=seq.assistant_mask[:n], logprobs=seq.logprobs[:n]
    )


def _skipped_reason(
    num_groups: int, zero: int, too_long: int, without_turns: int, nonzero: int, too_small: int = 0
) -> str:
    if num_groups == 0:
        return "no groups were given; gather some trajectory groups first"
    if too_small == num_groups:
        return (
            "every group has fewer than 2 finished rollouts (the others raised: see group.exceptions); fix the "
            "failing rollouts"
        )
    if nonzero and too_long == 0:
        return (
            f"no trajectory with a nonzero advantage has an assistant turn ({without_turns} histories have none); "
            "append each completion.choices[0] to the trajectory's messages_and_choices"
        )
    if too_long == 0:
        return (
            f"all {num_groups} group{'s' if num_groups != 1 else ''} had equal rewards within the group, so every "
            "advantage is 0; vary the scenario or the reward"
        )
    reason = (
        f"all {too_long} sequences with a nonzero advantage had no sampled token within their first "
        "max_seq_length tokens"
    )
    if zero:
        reason += f" ({zero} trajectories had advantage 0)"
    return reason + "; raise max_seq_length or shorten the rollouts' prompts"
