"""Supervised fine-tuning (SFT): its config, chat examples read from JSONL, and trajectories -> training batches.

Design choices, and why:
- An SFT call is a training step like a GRPO step (backends/train_step.py): one call trains its batches, then
  commits one checkpoint (step + 1) with its history row and its examples as the step's rollouts. So RL that
  follows starts from it, `range(await model.get_step(), N)` loops keep working, and a failed call changes
  nothing.
- Every assistant turn is a target, whether a `Choice` or a plain `{"role": "assistant", ...}` dict; system,
  user and tool messages are context (masked out). `assistant_turns="last"` (ART's option) trains only the
  last assistant turn and keeps the earlier ones as context.
- Tokenisation is tokenize.py's, so a conversation gives the same tokens in SFT and in RL: a Choice keeps the
  token ids the engine sampled, a dict is rendered by the chat template, and the end-of-turn token after an
  assistant turn is trained (the model must learn to stop).
- `batch_size` is trajectories per optimizer step, as in ART; "auto" means 2, ART's LocalBackend default.
  Batches are cut by position before over-length examples are dropped, so a learning-rate list (one value per
  batch, as ART's schedules make) keeps lining up with the data; a list of the wrong length is an error
  rather than a silently reused or ignored value.
- Examples longer than `max_seq_length` (default: the model's context) are dropped with one warning and a
  count in the step's metrics (ART issue #665), instead of failing the whole step.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from transformers import PreTrainedTokenizerBase

from . import metric_names as names
from .ignored import report_ignored
from .tokenize import TokenizedSequence, tokenize_history, trainable_turns
from .trajectory import History, Trajectory

AUTO_BATCH_SIZE = 2  # ART's LocalBackend default for batch_size="auto"
_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class TrainSFTConfig(BaseModel):
    """Options for one supervised fine-tuning call: `model.train_sft(trajectories, config=TrainSFTConfig(...))`.

    ART's default learning rate (5e-5) suits its 3B-32B models; the embedded 135M model with LoRA r=8 needs
    more. Measured on it (16 one-line examples teaching an "ANSWER: <WORD>" format it never uses, batches of
    4, greedy replies to 8 held-out questions in the format): 2e-4 -> 12% after 12 steps; 5e-4 -> 75% after 8
    steps, 88% after 12; 1e-3 -> 75% after 4 steps, 100% after 12, but by then it parrots the training answers.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    learning_rate: float | list[float] = Field(
        default=5e-4,
        description="AdamW learning rate, or one per batch (as create_sft_dataset_iterator and "
        "train_sft_from_file make them). 5e-4 teaches the embedded 135M model a new answer format in ~8 steps "
        "of 4 examples; use ART's 2e-5..2e-4 for 3B+ models",
    )
    batch_size: int | Literal["auto"] = Field(
        default="auto",
        description="trajectories per optimizer step; 'auto' = 2 (ART's LocalBackend default). Larger batches "
        "give smoother steps at the same cost per example",
    )
    assistant_turns: Literal["all", "last"] = Field(
        default="all",
        description="'all': train every assistant turn; 'last': only the last one, earlier turns are context",
    )
    max_seq_length: int | None = Field(
        default=None,
        ge=16,
        description="drop longer examples (counted in data/num_dropped_too_long); None = the model's context",
    )
    max_grad_norm: float = Field(
        default=1.0, gt=0, description="gradient clipping threshold per optimizer step"
    )
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay")
    micro_batch_tokens: int = Field(
        default=2048,
        ge=64,
        description="padded-token budget per forward/backward; lower it if memory runs out",
    )

    @field_validator("learning_rate")
    @classmethod
    def _positive_finite(cls, value: float | list[float]) -> float | list[float]:
        values = value if isinstance(value, list) else [value]
        if not values:
            raise ValueError("learning_rate is an empty list; give one learning rate per batch, or a number")
        bad = [v for v in values if not (math.isfinite(v) and v >= 0)]
        if bad:
            raise ValueError(f"learning rates must be finite and >= 0, got {bad[0]!r}")
        return value

    @field_validator("batch_size")
    @classmethod
    def _positive_batch(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError(f"batch_size must be >= 1 or 'auto', got {value}")
        return value

    def resolved_batch_size(self) -> int:
        return AUTO_BATCH_SIZE if self.batch_size == "auto" else int(self.batch_size)

    def learning_rates(self, num_batches: int) -> list[float]:
        """One learning rate per batch; ValueError when a list does not have exactly `num_batches` values."""
        if not isinstance(self.learning_rate, list):
            return [float(self.learning_rate)] * num_batches
        if len(self.learning_rate) != num_batches:
            raise ValueError(
                f"learning_rate has {len(self.learning_rate)} values, but the trajectories make {num_batches} "
                f"batch{'es' if num_batches != 1 else ''} of batch_size={self.resolved_batch_size()}; give one "
                "learning rate per batch (create_lr_schedule(num_batches, ...)), or a single number"
            )
        return [float(v) for v in self.learning_rate]


def merge_sft_config(
    config: TrainSFTConfig | None, options: dict[str, Any], dev_config: Mapping[str, Any] | None = None
) -> TrainSFTConfig:
    """`config`, then ART's experimental `_config` dict, then keyword `options` on top; TypeError naming the
    valid options for an unknown one. ART's `_config["metric_logging"]` is accepted and ignored."""
    dev = dict(dev_config or {})
    if dev.pop("metric_logging", None) is not None:
        report_ignored(
            "train_sft(_config={'metric_logging': ...})", "every SFT step records its metrics in the history"
        )
    unknown = sorted((set(dev) | set(options)) - set(TrainSFTConfig.model_fields))
    if unknown:
        raise TypeError(
            f"unknown SFT option(s) {unknown}; valid options: {sorted(TrainSFTConfig.model_fields)}"
        )
    base = config.model_dump(exclude_unset=True) if config is not None else {}
    return TrainSFTConfig(**{**base, **dev, **options})


# ----- chat examples from JSONL ---------------------------------------------------------------------------


def read_sft_jsonl(path: str | Path) -> list[Trajectory]:
    """Chat examples from a JSONL file, one `{"messages": [...], "tools": [...]}` object per line.

    Blank lines are skipped; other keys are ignored. Every line is checked before anything trains, and a bad
    one raises ValueError naming the file and line. Each trajectory's `metadata["source"]` is "file:line".

    >>> trajectories = read_sft_jsonl("train.jsonl")  # doctest: +SKIP
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (or is not a file); pass the path of a .jsonl file")
    out = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                out.append(sft_example(line, f"{path.name}:{number}"))
    return out


def sft_example(row: str | dict[str, Any], source: str) -> Trajectory:
    """One chat example (a JSONL line, or the object it holds) as a Trajectory; ValueError naming `source`."""
    where = f"{source}: "
    if isinstance(row, str):
        try:
            row = json.loads(row)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict) or "messages" not in row:
        raise ValueError(
            f'{where}expected an object like {{"messages": [...], "tools": [...]}}, got {_short(row)}'
        )
    messages, tools = row["messages"], row.get("tools")
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f'{where}"messages" must be a non-empty list of chat messages, got {_short(messages)}'
        )
    for k, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in _ROLES:
            raise ValueError(
                f"{where}messages[{k}] must be an object with a role in {list(_ROLES)}, got {_short(message)}"
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(
            f"{where}has no assistant message, so there is nothing to learn (SFT trains the assistant turns; "
            "system, user and tool messages are context)"
        )
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError(f'{where}"tools" must be a list of tool objects, got {_short(tools)}')
    try:
        return Trajectory(messages_and_choices=messages, tools=tools, metadata={"source": source})
    except (ValidationError, TypeError) as e:
        raise ValueError(f"{where}not a valid chat example: {e}") from None


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


# ----- trajectories -> training batches -------------------------------------------------------------------


@dataclass
class SFTBatches:
    """What one SFT call trains: batches of sequences, each one optimizer step at its learning rate."""

    batches: list[list[TokenizedSequence]]
    learning_rates: list[float]  # one per batch
    metrics: dict[str, float] = field(default_factory=dict)
    skipped_reason: str | None = None  # a sentence saying why there is nothing to train, None when there is

    @property
    def sequences(self) -> list[TokenizedSequence]:
        return [s for batch in self.batches for s in batch]


def _where(index: int, trajectory: Trajectory, history: int | None) -> str:
    source = trajectory.metadata.get("source")
    where = f"trajectory {index}" + (f" ({source})" if source else "")
    return where + (f", additional_histories[{history}]" if history is not None else "")


def _has_assistant_turn(history: History) -> bool:
    return any(
        isinstance(x, Choice) or (isinstance(x, dict) and x.get("role") == "assistant")
        for x in history.messages_and_choices
    )


def tokenize_sft_trajectory(
    tokenizer: PreTrainedTokenizerBase,
    trajectory: Trajectory,
    *,
    assistant_turns: Literal["all", "last"] = "all",
    index: int = 0,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[TokenizedSequence]:
    """One sequence per history (the messages, then each additional history) with the assistant turns as the
    trainable tokens, rendered with the chat template's variables `template_kwargs` (as in RL). ValueError
    naming the trajectory when a history has no assistant turn.
    """
    out = []
    for hi, history in enumerate(trajectory.histories()):
        where = _where(index, trajectory, hi - 1 if hi else None)
        if not _has_assistant_turn(history):
            raise ValueError(
                f"{where} has no assistant message, so there is nothing to learn (SFT trains the assistant "
                "turns; system, user and tool messages are context). Add the reply, or leave the example out"
            )
        turns = trainable_turns(history, tokenizer, where, allow_training_without_logprobs=True)
        if assistant_turns == "last":
            turns = turns[-1:]
        tools = history.tools if history.tools is not None else trajectory.tools
        out.append(
            tokenize_history(
                tokenizer, history, tools, turns, 1.0, 0, index, where, template_kwargs=template_kwargs
            )
        )
    return out


def tokenize_sft(
    tokenizer: PreTrainedTokenizerBase,
    trajectories: Sequence[Trajectory],
    config: TrainSFTConfig,
    *,
    max_seq_length: int | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> SFTBatches:
    """Cut `trajectories` into batches of `config.batch_size` (by position), tokenise them, and drop sequences
    longer than `max_seq_length` (one warning with the count). A batch left empty is skipped with its
    learning rate. Raises before tokenising when the learning-rate list does not fit the number of batches.
    `template_kwargs`: the chat template's variables (the model's `_internal_config["chat_template_kwargs"]`).
    """
    size = config.resolved_batch_size()
    chunks = [list(trajectories[i : i + size]) for i in range(0, len(trajectories), size)]
    rates = config.learning_rates(len(chunks))
    batches: list[list[TokenizedSequence]] = []
    kept_rates: list[float] = []
    dropped: list[str] = []
    index = 0
    for chunk, rate in zip(chunks, rates, strict=True):
        batch = []
        for trajectory in chunk:
            for seq in tokenize_sft_trajectory(
                tokenizer,
                trajectory,
                assistant_turns=config.assistant_turns,
                index=index,
                template_kwargs=template_kwargs,
            ):
                if max_seq_length is not None and len(seq.token_ids) > max_seq_length:
                    dropped.append(f"{_where(index, trajectory, None)}: {len(seq.token_ids)} tokens")
                else:
                    batch.append(seq)
            index += 1
        if batch:
            batches.append(batch)
            kept_rates.append(rate)
    if dropped:
        warnings.warn(
            f"artnb: dropped {len(dropped)} SFT sequence{'s' if len(dropped) != 1 else ''} longer than "
            f"max_seq_length={max_seq_length} ({'; '.join(dropped[:3])}{'; ...' if len(dropped) > 3 else ''}). "
            "Raise max_seq_length or shorten those examples",
            stacklevel=2,
        )
    sequences = [s for b in batches for s in b]
    metrics = {
        "num_trajectories": float(len(trajectories)),
        "num_sequences": float(len(sequences)),
        "num_dropped_too_long": float(len(dropped)),
        "num_trainable_tokens": float(sum(s.num_trainable_tokens() for s in sequences)),
        "num_tokens": float(sum(len(s.token_ids) for s in sequences)),
    }
    reason = None
    if not sequences:
        reason = (
            f"all {len(dropped)} sequences were longer than max_seq_length={max_seq_length}"
            if dropped
            else "no trajectories were given"
        )
    return SFTBatches(batches, kept_rates, metrics, reason)


def summarize_sft_updates(updates: Iterable[dict[str, float]]) -> dict[str, float]:
    """One SFT call's metrics from its optimizer steps' (PeftTrainer.train_sft): the loss per trainable token
    over all batches, the mean gradient norm and learning rate, token and step counts, throughput."""
    updates = list(updates)
    tokens = sum(u["num_trainable_tokens"] for u in updates)
    seconds = sum(u["seconds"] for u in updates)
    return {
        "sft_loss": sum(u["loss"] * u["num_trainable_tokens"] for u in updates) / tokens,
        "sft_loss_last_batch": updates[-1]["loss"],
        "grad_norm": sum(u["grad_norm"] for u in updates) / len(updates),
        "learning_rate": sum(u["learning_rate"] for u in updates) / len(updates),
        "num_gradient_steps": float(len(updates)),
        "num_trainable_tokens": float(tokens),
        "tokens_per_second": sum(u["tokens_per_second"] * u["seconds"] for u in updates) / seconds,
        "seconds": seconds,
    }


def sft_step_line(step: int, metrics: Mapping[str, Any], num_trajectories: int) -> str:
    """What `train_sft(..., verbose=True)` prints about a committed SFT step (`step`: the new step)."""
    m = metrics
    return (
        f"SFT step {step - 1} -> {step}: {num_trajectories} trajectories in "
        f"{m[names.trainer('num_gradient_steps')]:.0f} batches, loss {m[names.SFT_LOSS]:.4f}, "
        f"{m[names.data('num_dropped_too_long')]:.0f} dropped as too long, {m[names.trainer('seconds')]:.1f} s"
    )
