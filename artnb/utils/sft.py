"""`artnb.utils.sft`: ART's SFT helpers, with ART's calls: learning-rate schedules, a dataset cut into
`train_sft` calls, and training from a JSONL file of chat examples.

    for chunk in create_sft_dataset_iterator(trajectories, epochs=3, batch_size=4):
        await model.train_sft(chunk.trajectories, chunk.config)

    await train_sft_from_file(model, "train.jsonl", epochs=3, batch_size=2)

Differences from ART, on purpose:
- `peak_lr` defaults to 1e-3 (ART: 2e-4, for its 3B+ models). With the default warm-up and linear decay that
  averages 5e-4, TrainSFTConfig's default, which the embedded 135M model needs (measured; 2e-4 barely moves it).
- `train_sft_from_file` reads and checks the whole file before training (a bad line is an error naming it,
  before any step; ART streams and fails mid-way), shuffles all of it per epoch rather than through a buffer,
  and returns the step's TrainResult.
Each `train_sft` call is one committed step (one checkpoint), as in ART, so a chunked iterator checkpoints
after every chunk.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from ..core.ignored import report_ignored
from ..core.sft import TrainSFTConfig, read_sft_jsonl

if TYPE_CHECKING:
    from ..core.model import TrainableModel, TrainResult
    from ..core.trajectory import Trajectory

Schedule = Literal["cosine", "linear", "constant"]


class SFTChunk(NamedTuple):
    """One `train_sft` call's share of a dataset: its trajectories, their config (one learning rate per
    batch), and where it sits: the global batch step it starts at, its epoch, and the batch step within it."""

    trajectories: list[Trajectory]
    config: TrainSFTConfig
    step: int
    epoch: int
    epoch_step: int


def create_lr_schedule(
    total_steps: int,
    peak_lr: float,
    method: Schedule = "linear",
    warmup_steps: int = 0,
    min_lr: float = 0.0,
) -> list[float]:
    """One learning rate per step: a linear warm-up from `min_lr` to `peak_lr` over `warmup_steps` (the first
    step already above `min_lr`), then "constant", or a "linear" or "cosine" decay that reaches `min_lr` at
    the last step.

    >>> [round(x, 2) for x in create_lr_schedule(5, 1.0, "linear", warmup_steps=1)]
    [1.0, 1.0, 0.67, 0.33, 0.0]
    """
    if method not in ("cosine", "linear", "constant"):
        raise ValueError(f"method={method!r}: choose 'cosine', 'linear' or 'constant'")
    rates = []
    decay_steps = total_steps - warmup_steps
    for step in range(max(total_steps, 0)):
        if step < warmup_steps:
            rates.append(min_lr + (peak_lr - min_lr) * (step + 1) / warmup_steps)
            continue
        done = (step - warmup_steps) / (decay_steps - 1) if decay_steps > 1 else 0.0  # 0 -> 1 over the decay
        if method == "constant":
            left = 1.0
        elif method == "linear":
            left = 1.0 - done
        else:
            left = (1.0 + math.cos(math.pi * done)) / 2
        rates.append(min_lr + (peak_lr - min_lr) * left)
    return rates


def create_sft_dataset_iterator(
    trajectories: Sequence[Trajectory],
    chunk_size: int = 10,
    epochs: int = 1,
    batch_size: int = 2,
    peak_lr: float = 1e-3,
    schedule_type: Schedule = "linear",
    warmup_ratio: float = 0.1,
    shuffle: bool = True,
    seed: int = 42,
    initial_step: int = 0,
    show_progress: bool = True,
) -> Iterator[SFTChunk]:
    """Cut a dataset into `model.train_sft` calls of `chunk_size` batches each, with one learning-rate schedule
    over all epochs (so warm-up and decay span the whole run, not each call).

    Each epoch is shuffled with `seed + epoch`. `initial_step` (a batch step, e.g. `chunk.step` of the chunk
    to resume at) skips the chunks before the one holding it. A progress bar counts batches.

    >>> for chunk in create_sft_dataset_iterator(trajectories, epochs=3, batch_size=4):  # doctest: +SKIP
    ...     await model.train_sft(chunk.trajectories, chunk.config)
    """
    from tqdm.auto import tqdm

    if chunk_size < 1 or batch_size < 1 or epochs < 1:
        raise ValueError(
            f"chunk_size, batch_size and epochs must be >= 1 (got {chunk_size}, {batch_size}, {epochs})"
        )
    items = list(trajectories)
    if not items:
        return
    batches_per_epoch = math.ceil(len(items) / batch_size)
    total = batches_per_epoch * epochs
    rates = create_lr_schedule(total, peak_lr, schedule_type, warmup_steps=int(total * warmup_ratio))
    with tqdm(total=total, desc="SFT", unit="batch", disable=not show_progress) as bar:
        for epoch in range(epochs):
            order = list(items)
            if shuffle:
                random.Random(seed + epoch).shuffle(order)
            for epoch_step in range(0, batches_per_epoch, chunk_size):  # the chunk's first batch in the epoch
                part = order[epoch_step * batch_size : (epoch_step + chunk_size) * batch_size]
                step = epoch * batches_per_epoch + epoch_step
                num_batches = math.ceil(len(part) / batch_size)
                if step + num_batches > initial_step:
                    config = TrainSFTConfig(
                        learning_rate=rates[step : step + num_batches], batch_size=batch_size
                    )
                    yield SFTChunk(part, config, step, epoch, epoch_step)
                bar.update(num_batches)


async def train_sft_from_file(
    model: TrainableModel,
    file_path: str | Path,
    epochs: int = 1,
    batch_size: int = 2,
    peak_lr: float = 1e-3,
    schedule_type: Schedule = "linear",
    warmup_ratio: float = 0.1,
    initial_step: int = 0,
    final_step: int | None = None,
    _config: Mapping[str, Any] | None = None,
    verbose: bool = False,
    assistant_turns: Literal["all", "last"] = "all",
    shuffle_buffer_size: int | None = None,
    log_metrics: bool = True,
) -> TrainResult | None:
    """Supervised fine-tuning on a JSONL file of chat examples (`{"messages": [...], "tools": [...]}` per
    line), `epochs` times in shuffled order, with a learning-rate schedule over all its batches, in one
    `model.train_sft` call (one committed step).

    `initial_step` and `final_step` are batch steps: train batches [initial_step, final_step) of the whole
    schedule, e.g. to split a long run into calls with evaluations between them. Every line is checked
    first; a bad one raises ValueError naming it, and nothing trains. Returns the step's TrainResult, or None
    when `initial_step` is past the end. `assistant_turns="last"` trains only each row's last assistant
    message (earlier ones are context). ART's `shuffle_buffer_size` and `log_metrics=False` are accepted and
    reported: the whole file is shuffled, and every step records its metrics.

    >>> await train_sft_from_file(model, "train.jsonl", epochs=3, batch_size=2)  # doctest: +SKIP
    """
    if shuffle_buffer_size is not None:
        report_ignored(
            "train_sft_from_file(shuffle_buffer_size=...)",
            "the whole file is read, checked and shuffled per epoch (no streaming buffer)",
        )
    if not log_metrics:
        report_ignored(
            "train_sft_from_file(log_metrics=False)", "every SFT step records its metrics in the history"
        )
    examples = read_sft_jsonl(file_path)
    if not examples:
        raise ValueError(f"{file_path} has no examples (only blank lines); nothing to train on")
    if epochs < 1 or batch_size < 1:
        raise ValueError(f"epochs and batch_size must be >= 1 (got {epochs}, {batch_size})")
    total = math.ceil(len(examples) * epochs / batch_size)
    schedule = create_lr_schedule(total, peak_lr, schedule_type, warmup_steps=int(total * warmup_ratio))
    rates = schedule[initial_step:final_step]
    if not rates:
        if verbose:
            print(f"{file_path}: batches {initial_step}..{final_step} of {total} are empty; nothing to train")
        return None
    order: list[Trajectory] = []
    for epoch in range(epochs):
        shuffled = list(examples)
        random.Random(42 + epoch).shuffle(shuffled)
        order.extend(shuffled)
    start = initial_step * batch_size
    trajectories = order[start : start + len(rates) * batch_size]
    if verbose:
        print(
            f"{file_path}: {len(examples)} examples x {epochs} epochs = {total} batches of {batch_size}; training "
            f"batches {initial_step}..{initial_step + len(rates) - 1}, {schedule_type} schedule, peak_lr {peak_lr}"
        )
    config = TrainSFTConfig(learning_rate=rates, batch_size=batch_size, assistant_turns=assistant_turns)
    return await model.train_sft(trajectories, config, _config=_config, verbose=verbose)
