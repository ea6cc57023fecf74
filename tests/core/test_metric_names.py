"""The metric schema (artnb/core/metric_names.py): every name artnb writes is defined there, and each value is written
once per step. Checked two ways: the string constants in artnb's source, and the rows real training writes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from tiny_loop import gather

import artnb as art
from artnb.core import metric_names as metrics
from artnb.models import tiny

BASE = tiny(hidden_size=64, num_layers=2, seed=1)
SECTIONS = ("train/", "val/", "test/", "data/", "time/", "costs/")
PACKAGE = Path(art.__file__).parent


def metric_literals() -> list[tuple[str, str]]:
    """(file, string) for every string constant in artnb that is shaped like a metric name."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
                if text.startswith(SECTIONS) and " " not in text and text.count("/") >= 1 and text[-1] != "/":
                    found.append((str(path.relative_to(PACKAGE)), text))
    return found


def test_every_metric_name_in_the_source_is_defined():
    literals = metric_literals()
    assert ("core/metric_names.py", "time/step_train_s") in literals  # the scan sees the schema's own names
    undefined = [(f, text) for f, text in literals if metrics.describe(text) is None]
    assert not undefined, f"metric names not in artnb/core/metric_names.py: {undefined}"


def test_names_are_built_and_checked():
    assert metrics.split_metric("val", metrics.std_of("reward")) == "val/reward_std_dev"
    assert metrics.cost("judge/ruler", "usd") == "costs/judge/ruler/usd"
    assert metrics.describe("costs/judge/ruler/usd").startswith("estimated spend")
    assert metrics.describe("val/my_own_metric") is None
    assert metrics.describe(metrics.split_metric("train", metrics.TRAJECTORIES_TABLE)).startswith("W&B only")
    with pytest.raises(KeyError, match="metric_names.py"):
        metrics.trainer("lost")
    with pytest.raises(ValueError, match="costs/<source>"):
        metrics.cost("judge ruler", "usd")
    assert metrics.drop_duplicates({"train/reward": 1, "data/reward": 1, "data/num_groups": 2}) == {
        "train/reward": 1,
        "data/num_groups": 2,
    }


async def test_rows_written_by_training_use_only_defined_names_once(tmp_path):
    model = art.TrainableModel(name="agent", project="schema", base_model=BASE)
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        await model.train(await gather(model, 0), config=art.TrainConfig(learning_rate=1e-2))
        same = await gather(model, 1)
        for group in same:
            for t in group:
                t.reward = 0.5
        await model.train(same)  # no update: equal rewards
        await model.train([], config=art.TrainConfig(on_nothing_to_train="skip"))
        await model.log(await gather(model, 2), split="val")
        examples = [
            art.Trajectory(
                messages_and_choices=[
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "A"},
                ]
            )
        ] * 2
        await model.train_sft(examples, art.TrainSFTConfig(batch_size=2, learning_rate=1e-3))
    rows = [row for _, row in model.history().iterrows()]
    assert len(rows) == 5
    for row in rows:
        written = {
            k for k, v in row.items() if v == v and k not in ("step", "split", "recorded_at", "commit")
        }
        undefined = sorted(k for k in written if metrics.describe(k) is None)
        assert not undefined, f"step {row['step']} {row['split']}: {undefined}"
        twice = sorted(k for k in written if k.startswith("data/") and "train/" + k[5:] in written)
        assert not twice, f"written twice: {twice}"
