"""`train_sft_from_file` takes the keywords ART's SFT docs pass: `assistant_turns="last"` trains only each row's
last assistant message; `shuffle_buffer_size` and `log_metrics=False` are accepted and reported once."""

from __future__ import annotations

import json

import pytest

import artnb as art
from artnb import models
from artnb.core import ignored
from artnb.utils.sft import train_sft_from_file

ROWS = [
    [
        {"role": "user", "content": f"Say the colour number {i}."},
        {"role": "assistant", "content": "I will say a long sentence about colours first, then the colour."},
        {"role": "user", "content": "Now only the colour."},
        {"role": "assistant", "content": colour},
    ]
    for i, colour in enumerate(["RED", "BLUE", "GREEN", "GOLD"])
]


@pytest.fixture
def train_file(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"messages": messages}) + "\n" for messages in ROWS))
    return str(path)


async def test_assistant_turns_last_trains_only_the_last_reply(tmp_path, train_file, monkeypatch):
    monkeypatch.setattr(ignored, "_reported", set())
    base = models.tiny(hidden_size=64, num_layers=2, seed=1)
    trained_tokens = {}
    backend = art.LocalBackend(path=str(tmp_path / "art"), engine="hf")
    with pytest.warns(UserWarning, match="shuffle_buffer_size") as caught:  # reported once, not per call
        for turns in ("all", "last"):
            model = art.TrainableModel(name=f"sft-{turns}", project="p", base_model=base)
            await model.register(backend)
            result = await train_sft_from_file(
                model=model,
                file_path=train_file,
                epochs=1,
                batch_size=2,
                peak_lr=2e-4,
                schedule_type="cosine",
                warmup_ratio=0.1,
                assistant_turns=turns,
                shuffle_buffer_size=10000,
                verbose=True,
            )
            assert result.step == 1
            trained_tokens[turns] = model.history().iloc[0]["train/num_trainable_tokens"]
    await backend.close()
    assert sum("shuffle_buffer_size" in str(w.message) for w in caught) == 1
    # the long first reply of each row is context under "last": far fewer tokens carry the loss
    assert 0 < trained_tokens["last"] < trained_tokens["all"] / 2


async def test_log_metrics_false_is_reported_and_the_step_still_records(tmp_path, train_file, monkeypatch):
    monkeypatch.setattr(ignored, "_reported", set())
    model = art.TrainableModel(
        name="sft", project="p", base_model=models.tiny(hidden_size=64, num_layers=2, seed=1)
    )
    async with art.LocalBackend(path=str(tmp_path / "art"), engine="hf") as backend:
        await model.register(backend)
        with pytest.warns(UserWarning, match=r"train_sft_from_file\(log_metrics=False\) is accepted"):
            await train_sft_from_file(model=model, file_path=train_file, log_metrics=False)
        assert "train/sft_loss" in model.history().columns
