"""Batches of a dataset for a training loop that can stop and resume at any step.

`iterate_dataset(items, groups_per_step=4, num_epochs=3, initial_step=await model.get_step())` yields one
batch per training step. Each epoch visits the items in a shuffled order that depends only on the epoch number,
so a run restarted at step N gets exactly the batches the uninterrupted run would have had from step N on.

Design choices, and where this departs from OpenPipe ART's `art.utils.iterate_dataset`:
- Same batches as ART: epoch e is shuffled as `random.seed(e); random.shuffle(indices)` would, and the last
  batch of an epoch is shorter when the dataset does not divide evenly (it is kept, not dropped). A run started
  with ART resumes here on the same items.
- The shuffle uses its own `random.Random(epoch)`; ART reseeds the global `random` module, which silently
  resets any randomness the notebook relies on (e.g. sampling scenarios) at every epoch.
- A batch is a `DatasetBatch` that works with both ART APIs: `batch.items`, `batch.step`, `batch.epoch`,
  `batch.epoch_step` (ART 0.5) and `for items, epoch, global_step, epoch_step in iterate_dataset(...)`
  (ART 0.3-0.4), because it is a named tuple in that order.
- The progress bar is closed when the loop `break`s (ART leaves it open).
"""

from __future__ import annotations

import math
import random
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from tqdm.auto import tqdm


class DatasetBatch(NamedTuple):
    """One training step's items. Unpacks as `(items, epoch, global_step, epoch_step)` like ART 0.3-0.4."""

    items: list[Any]  # the dataset items of this step, in shuffled order
    epoch: int  # 0-based pass over the dataset
    step: int  # global step across epochs: epoch * steps_per_epoch + epoch_step
    epoch_step: int  # 0-based step within the epoch

    @property
    def global_step(self) -> int:
        """The name ART 0.3-0.4's tuple used for `step`."""
        return self.step


def iterate_dataset(
    dataset: Sequence[Any],
    groups_per_step: int = 1,
    num_epochs: int = 1,
    initial_step: int = 0,
    use_tqdm: bool = True,
) -> Iterator[DatasetBatch]:
    """Yield `DatasetBatch`es of `groups_per_step` items, epoch after epoch, from global step `initial_step` on.

    Steps per epoch is `ceil(len(dataset) / groups_per_step)`; the epoch's last batch holds the remainder.

    >>> for batch in iterate_dataset(scenarios, groups_per_step=8, num_epochs=2, initial_step=await model.get_step()):
    ...     groups = await art.gather_trajectory_groups(
    ...         art.TrajectoryGroup(rollout(model, s) for _ in range(4)) for s in batch.items)
    ...     await model.train(groups)
    """
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise TypeError(
            f"iterate_dataset needs a sequence it can index (a list, a tuple, a datasets.Dataset), got "
            f"{type(dataset).__name__}; wrap a generator or iterator in list(...) first"
        )
    if not isinstance(groups_per_step, int) or groups_per_step < 1:
        raise ValueError(
            f"groups_per_step={groups_per_step!r}: it is the batch size, so it must be an int >= 1"
        )
    if not isinstance(num_epochs, int) or num_epochs < 0:
        raise ValueError(
            f"num_epochs={num_epochs!r}: pass the number of passes over the dataset, an int >= 0"
        )
    if not isinstance(initial_step, int) or initial_step < 0:
        raise ValueError(
            f"initial_step={initial_step!r}: pass the global step to resume from (e.g. await model.get_step()), "
            "an int >= 0"
        )
    size = len(dataset)
    if size == 0:
        warnings.warn("iterate_dataset got an empty dataset, so it yields no batches", stacklevel=2)
        return

    steps_per_epoch = math.ceil(size / groups_per_step)
    bar = (
        tqdm(total=steps_per_epoch * num_epochs, initial=initial_step, desc="Iterating dataset", unit="batch")
        if use_tqdm
        else None
    )
    try:
        for epoch in range(num_epochs):
            first = epoch * steps_per_epoch
            if first + steps_per_epoch <= initial_step:
                continue  # the whole epoch is before the resume point: no need to shuffle it
            order = list(range(size))
            random.Random(epoch).shuffle(order)
            for epoch_step in range(max(0, initial_step - first), steps_per_epoch):
                chosen = order[epoch_step * groups_per_step : (epoch_step + 1) * groups_per_step]
                yield DatasetBatch([dataset[i] for i in chosen], epoch, first + epoch_step, epoch_step)
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
