"""SFT without a model: which tokens train, batches and learning rates, JSONL examples, the schedule helpers."""

from __future__ import annotations

import json
import math

import pytest
from openai.types.chat.chat_completion import Choice
from pydantic import ValidationError
from transformers import AutoTokenizer

import artnb.models
from artnb.core.sft import (
    TrainSFTConfig,
    merge_sft_config,
    read_sft_jsonl,
    tokenize_sft,
    tokenize_sft_trajectory,
)
from artnb.core.tokenize import TokenizedSequence
from artnb.core.trajectory import History, Trajectory
from artnb.utils.sft import create_lr_schedule, create_sft_dataset_iterator


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(artnb.models.tiny())


def spans(tok, seq: TokenizedSequence) -> list[str]:
    """The decoded runs of consecutive trainable tokens."""
    out: list[list[int]] = []
    prev = False
    for t, m in zip(seq.token_ids, seq.assistant_mask, strict=True):
        if m and not prev:
            out.append([])
        if m:
            out[-1].append(t)
        prev = m
    return [tok.decode(s) for s in out]


def context(tok, seq: TokenizedSequence) -> str:
    return tok.decode([t for t, m in zip(seq.token_ids, seq.assistant_mask, strict=True) if not m])


def chat(*replies: str, system: str = "Be terse.") -> Trajectory:
    items: list = [{"role": "system", "content": system}]
    for n, reply in enumerate(replies):
        items += [{"role": "user", "content": f"question {n}"}, {"role": "assistant", "content": reply}]
    return Trajectory(messages_and_choices=items)


def test_every_assistant_turn_trains_and_the_rest_is_context(tok):
    choice = Choice.model_validate(
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ANSWER: B"}}
    )
    traj = chat("Hello there")
    traj.messages_and_choices += [
        {"role": "user", "content": "and now?"},
        choice,  # a Choice without logprobs (e.g. from another model) trains like a dict
        {"role": "user", "content": "last words"},
        {"role": "assistant", "content": "ANSWER: BYE"},
    ]
    [seq] = tokenize_sft_trajectory(tok, traj)
    assert spans(tok, seq) == ["Hello there<|im_end|>", "ANSWER: B<|im_end|>", "ANSWER: BYE<|im_end|>"]
    rest = context(tok, seq)
    for text in ("Be terse.", "question 0", "and now?", "last words", "<|im_start|>assistant\n"):
        assert text in rest
    assert "Hello" not in rest and "ANSWER" not in rest
    assert tok.decode(seq.token_ids) == tok.apply_chat_template(traj.messages(), tokenize=False)

    # "last": only the final reply trains; the earlier ones are rendered as context
    [last] = tokenize_sft_trajectory(tok, traj, assistant_turns="last")
    assert spans(tok, last) == ["ANSWER: BYE<|im_end|>"]
    assert last.token_ids == seq.token_ids and "Hello there" in context(tok, last)


def test_a_sampled_choice_trains_its_exact_token_ids(tok):
    ids = [i for p in ("hel", "lo") for i in tok.encode(p, add_special_tokens=False)] + [tok.eos_token_id]
    assert tok.encode("hello", add_special_tokens=False) != ids[:-1]  # re-tokenising would differ
    choice = Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": "hello"},
            "logprobs": {
                "content": [
                    {"token": tok.decode([i]), "logprob": -0.5, "bytes": None, "top_logprobs": []}
                    for i in ids
                ]
            },
            "token_ids": ids,
        }
    )
    traj = Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}, choice])
    [seq] = tokenize_sft_trajectory(tok, traj)
    assert [t for t, m in zip(seq.token_ids, seq.assistant_mask, strict=True) if m] == ids


def test_additional_histories_are_sequences_and_a_history_without_a_reply_is_an_error(tok):
    traj = chat("one")
    traj.additional_histories = [History(messages_and_choices=chat("two").messages_and_choices)]
    seqs = tokenize_sft_trajectory(tok, traj)
    assert [spans(tok, s) for s in seqs] == [["one<|im_end|>"], ["two<|im_end|>"]]

    mute = Trajectory(
        messages_and_choices=[{"role": "user", "content": "hi"}], metadata={"source": "a.jsonl:7"}
    )
    with pytest.raises(ValueError, match=r"trajectory 3 \(a.jsonl:7\) has no assistant message"):
        tokenize_sft_trajectory(tok, mute, index=3)


def test_batches_learning_rates_and_over_length_examples(tok):
    trajs = [chat(f"reply {i}") for i in range(5)]
    config = TrainSFTConfig(learning_rate=[3e-4, 2e-4, 1e-4], batch_size=2)
    out = tokenize_sft(tok, trajs, config)
    assert [len(b) for b in out.batches] == [2, 2, 1] and out.learning_rates == [3e-4, 2e-4, 1e-4]
    assert len(out.batches) == 3 and out.metrics["num_dropped_too_long"] == 0
    assert out.metrics["num_trainable_tokens"] == sum(s.num_trainable_tokens() for s in out.sequences)
    assert [s.trajectory_index for s in out.sequences] == [0, 1, 2, 3, 4]

    with pytest.raises(ValueError, match=r"learning_rate has 2 values, but the trajectories make 3 batches"):
        tokenize_sft(tok, trajs, TrainSFTConfig(learning_rate=[1e-4, 1e-4], batch_size=2))

    # the last batch's example is too long: dropped with a count, and its batch (and learning rate) skipped
    trajs[4] = chat("a much longer reply " * 20)
    limit = max(len(s.token_ids) for s in out.sequences[:4])
    with pytest.warns(
        UserWarning, match=r"dropped 1 SFT sequence longer than max_seq_length=\d+ \(trajectory 4:"
    ):
        out = tokenize_sft(tok, trajs, config, max_seq_length=limit)
    assert out.learning_rates == [3e-4, 2e-4] and out.metrics["num_dropped_too_long"] == 1
    with pytest.warns(UserWarning, match="dropped 5 SFT sequences"):
        out = tokenize_sft(tok, trajs, config, max_seq_length=16)
    assert out.sequences == [] and "all 5 sequences were longer" in out.skipped_reason


def test_config_is_strict_and_merges_options():
    assert TrainSFTConfig().resolved_batch_size() == 2  # "auto", as ART's LocalBackend
    assert TrainSFTConfig(batch_size=8).resolved_batch_size() == 8
    assert TrainSFTConfig(learning_rate=1e-4).learning_rates(3) == [1e-4] * 3
    assert TrainSFTConfig(learning_rate=[1e-4, 0.0]).learning_rates(2) == [1e-4, 0.0]  # schedules end at 0
    for bad in ({"learning_rate": []}, {"learning_rate": [1e-4, math.nan]}, {"learning_rate": -1.0}):
        with pytest.raises(ValidationError, match="learning"):
            TrainSFTConfig(**bad)
    with pytest.raises(ValidationError, match="batch_size"):
        TrainSFTConfig(batch_size=0)
    with pytest.raises(ValidationError, match="extra"):
        TrainSFTConfig(learning_rte=1e-4)

    merged = merge_sft_config(TrainSFTConfig(batch_size=4), {"learning_rate": 1e-4}, {"max_seq_length": 512})
    assert (merged.batch_size, merged.learning_rate, merged.max_seq_length) == (4, 1e-4, 512)
    with pytest.raises(TypeError, match=r"unknown SFT option\(s\) \['learning_rte'\]"):
        merge_sft_config(None, {"learning_rte": 1e-4})
    with pytest.warns(UserWarning, match="metric_logging.*ignored"):
        merge_sft_config(None, {}, {"metric_logging": {"enabled": False}})


def test_jsonl_examples_and_errors_that_name_the_line(tmp_path):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ANSWER: HI"}]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps({**good, "tools": tools, "id": 7}) + "\n")
    first, second = read_sft_jsonl(path)
    assert first.messages() == good["messages"] and first.metadata == {"source": "train.jsonl:1"}
    assert second.tools == tools and second.metadata["source"] == "train.jsonl:3"

    bad_rows = {
        '{"messages": [': "not valid JSON",
        "[1, 2]": 'expected an object like {"messages"',
        '{"messages": []}': '"messages" must be a non-empty list',
        '{"messages": [{"content": "hi"}]}': r"messages\[0\] must be an object with a role",
        '{"messages": [{"role": "user", "content": "hi"}]}': "has no assistant message",
        '{"messages": [{"role": "assistant", "content": "x"}], "tools": {"a": 1}}': '"tools" must be a list',
    }
    for row, message in bad_rows.items():
        path.write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n" + row + "\n")
        with pytest.raises(ValueError, match=r"^train.jsonl:3: " + message):
            read_sft_jsonl(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_sft_jsonl(tmp_path / "missing.jsonl")


def test_lr_schedules():
    assert create_lr_schedule(4, 1.0, "constant") == [1.0] * 4
    assert create_lr_schedule(5, 1.0, "linear") == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    assert create_lr_schedule(3, 1.0, "cosine", min_lr=0.1) == pytest.approx([1.0, 0.55, 0.1])
    assert create_lr_schedule(4, 1.0, "linear", warmup_steps=2) == pytest.approx([0.5, 1.0, 1.0, 0.0])
    assert create_lr_schedule(1, 1.0) == [1.0] and create_lr_schedule(0, 1.0) == []
    with pytest.raises(ValueError, match="method='step'"):
        create_lr_schedule(3, 1.0, "step")


def test_dataset_iterator_spans_one_schedule_over_its_chunks():
    trajs = [Trajectory(metadata={"i": i}) for i in range(7)]
    chunks = list(
        create_sft_dataset_iterator(
            trajs, chunk_size=2, epochs=2, batch_size=2, peak_lr=1.0, show_progress=False
        )
    )
    # 4 batches per epoch in chunks of 2 batches: [4, 3] trajectories per epoch
    assert [(c.step, c.epoch, c.epoch_step, len(c.trajectories)) for c in chunks] == [
        (0, 0, 0, 4), (2, 0, 2, 3), (4, 1, 0, 4), (6, 1, 2, 3),
    ]  # fmt: skip
    rates = [lr for c in chunks for lr in c.config.learning_rate]
    assert rates == create_lr_schedule(8, 1.0, "linear", warmup_steps=0)
    assert all(c.config.batch_size == 2 for c in chunks)
    for epoch in (0, 1):  # each epoch is a permutation, shuffled by seed + epoch
        seen = [t.metadata["i"] for c in chunks if c.epoch == epoch for t in c.trajectories]
        assert sorted(seen) == list(range(7)) and seen != list(range(7))
    again = create_sft_dataset_iterator(trajs, chunk_size=2, epochs=2, batch_size=2, show_progress=False)
    assert [c.trajectories for c in again] == [c.trajectories for c in chunks]

    resumed = list(
        create_sft_dataset_iterator(
            trajs, chunk_size=2, epochs=2, batch_size=2, initial_step=5, show_progress=False
        )
    )
    assert [c.step for c in resumed] == [4, 6]  # the chunk holding batch 5, then the rest
    assert list(create_sft_dataset_iterator([], show_progress=False)) == []
