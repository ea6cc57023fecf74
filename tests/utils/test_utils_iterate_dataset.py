"""iterate_dataset: resuming at a step gives the uninterrupted run's batches; ART's shuffle and both APIs."""

import random
import sys

import pytest

from artnb.utils import DatasetBatch, iterate_dataset


def batches(**kwargs):
    return list(iterate_dataset(list(range(10)), use_tqdm=False, **kwargs))


def test_resume_at_initial_step_continues_the_uninterrupted_run():
    full = batches(groups_per_step=3, num_epochs=3)
    for start in (0, 1, 4, 5, 11, 12):
        assert batches(groups_per_step=3, num_epochs=3, initial_step=start) == full[start:]


def test_steps_epochs_and_a_short_last_batch():
    full = batches(groups_per_step=3, num_epochs=2)
    assert [b.step for b in full] == list(range(8))  # ceil(10 / 3) = 4 steps per epoch
    assert [(b.epoch, b.epoch_step) for b in full[3:5]] == [(0, 3), (1, 0)]
    assert [len(b.items) for b in full[:4]] == [3, 3, 3, 1]  # the remainder is kept, not dropped
    for epoch in (0, 1):
        seen = [x for b in full if b.epoch == epoch for x in b.items]
        assert sorted(seen) == list(range(10))  # each epoch visits every item once


def test_shuffle_is_arts_per_epoch_order_without_touching_global_random():
    random.seed(123)
    state = random.getstate()
    full = batches(groups_per_step=10, num_epochs=2)
    assert (
        random.getstate() == state
    )  # ART reseeds the global generator; a notebook's own draws must not change
    # the orders ART produces (random.seed(epoch); random.shuffle(indices)), so an ART run resumes on the same items
    assert full[0].items == [7, 8, 1, 5, 3, 4, 2, 0, 9, 6]
    assert full[1].items == [6, 8, 9, 7, 5, 3, 0, 4, 1, 2]
    assert batches(groups_per_step=10, num_epochs=2) == full  # deterministic across calls


def test_a_batch_is_arts_dataclass_and_arts_older_tuple():
    batch = batches(groups_per_step=4, initial_step=1)[0]
    assert (batch.step, batch.epoch, batch.epoch_step, len(batch.items)) == (1, 0, 1, 4)
    items, epoch, global_step, epoch_step = batch  # ART 0.3-0.4 unpacking
    assert (items, epoch, global_step, epoch_step) == (batch.items, 0, 1, 1)
    assert batch.global_step == 1
    assert batch == DatasetBatch(items=batch.items, step=1, epoch=0, epoch_step=1)  # ART 0.5 keywords


def test_progress_bar_closes_when_the_loop_breaks(monkeypatch):
    module = sys.modules[
        "artnb.utils.iterate_dataset"
    ]  # the package's attribute of that name is the function

    bars = []

    class Bar:
        def __init__(self, **kwargs):
            self.kwargs, self.updates, self.closed = kwargs, 0, False
            bars.append(self)

        def update(self, n):
            self.updates += n

        def close(self):
            self.closed = True

    monkeypatch.setattr(module, "tqdm", Bar)
    iterator = iterate_dataset(list(range(10)), groups_per_step=2, num_epochs=2, initial_step=3)
    for batch in iterator:
        if batch.step == 5:
            break
    iterator.close()
    (bar,) = bars
    assert (bar.kwargs["initial"], bar.kwargs["total"], bar.updates, bar.closed) == (3, 10, 2, True)


def test_bad_arguments_say_what_to_pass():
    with pytest.raises(TypeError, match=r"list\(\.\.\.\)"):
        next(iterate_dataset(x for x in range(3)))
    with pytest.raises(ValueError, match="groups_per_step"):
        next(iterate_dataset([1, 2], groups_per_step=0))
    with pytest.raises(ValueError, match="initial_step"):
        next(iterate_dataset([1, 2], initial_step=-1))
    with pytest.warns(UserWarning, match="empty dataset"):
        assert list(iterate_dataset([], use_tqdm=False)) == []
