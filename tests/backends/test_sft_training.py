"""SFT through LocalBackend: a step that commits like an RL step, failures that change nothing, learning-rate
lists, training from a JSONL file, RL after SFT, and RL started from an SFT adapter directory.

Tiny random model and the HF engine, except the slow test: the embedded model learns an answer format.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading

import pytest
import torch
from peft import get_peft_model_state_dict
from safetensors.torch import load_file
from tiny_loop import gather

import artnb as art
from artnb.core.sft import TrainSFTConfig
from artnb.models import adapter_directory, resolve_base_model, tiny
from artnb.utils.sft import create_lr_schedule, train_sft_from_file


@pytest.fixture(scope="module")
def base():
    return tiny(hidden_size=64, num_layers=2, seed=1)


def example(question: str, answer: str) -> art.Trajectory:
    return art.Trajectory(
        messages_and_choices=[
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": question},
            {"role": "assistant", "content": f"ANSWER: {answer}"},
        ]
    )


EXAMPLES = [example(f"question {i}?", w) for i, w in enumerate(["RED", "BLUE", "GREEN", "GOLD", "GREY"])]


def weights(path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "adapter_model.safetensors"))


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **tol) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], **tol) for k in a)


def trainer_state(backend, model) -> dict[str, torch.Tensor]:
    return {
        k: v.detach().cpu() for k, v in get_peft_model_state_dict(backend.trainer_of(model).model).items()
    }


def record_learning_rates(backend, model) -> list[float]:
    """Spy on the trainer: the learning rate of each SFT optimizer step."""
    trainer, seen = backend.trainer_of(model), []
    original = trainer.train_sft

    def spy(sequences, learning_rate, **kw):
        seen.append(learning_rate)
        return original(sequences, learning_rate, **kw)

    trainer.train_sft = spy
    return seen


async def served_names(model) -> set[str]:
    return {m.id for m in (await model.openai_client().models.list()).data}


async def test_an_sft_step_commits_like_an_rl_step(tmp_path, base):
    model = art.TrainableModel(name="agent", project="p", base_model=base)
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        rates = record_learning_rates(backend, model)
        config = TrainSFTConfig(learning_rate=[3e-3, 2e-3, 1e-3], batch_size=2)
        result = await model.train_sft(EXAMPLES, config)

        assert result.step == 1 and await model.get_step() == 1 and model.store.steps() == [0, 1]
        assert result.checkpoint_path.endswith("checkpoints/0001") and rates == [3e-3, 2e-3, 1e-3]
        assert not same(weights(model.store.checkpoint_path(0)), weights(model.store.checkpoint_path(1)))
        assert same(trainer_state(backend, model), weights(model.store.checkpoint_path(1)))
        [row] = model.history().to_dict("records")
        assert row["step"] == 0 and row["split"] == "train" and "train/reward" not in row
        assert row["train/num_gradient_steps"] == 3 and row["data/num_trajectories"] == 5
        assert row["train/sft_loss"] > 0 and row["train/sft_loss"] == result.metrics["train/sft_loss"]
        [group] = model.store.read_trajectories("train", 0)
        logged = [[{k: v for k, v in m.items() if k != "trainable"} for m in t.messages()] for t in group]
        assert logged == [t.messages() for t in EXAMPLES]
        assert "agent@1" in await served_names(model)
        reply = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert reply.model == "agent@1"

        # keywords of backend.train_sft override the config, as with backend.train
        result = await backend.train_sft(model, EXAMPLES[:2], config, learning_rate=1e-3, batch_size=1)
        assert result.step == 2 and rates[3:] == [1e-3, 1e-3]


async def test_a_failed_or_cancelled_sft_step_changes_nothing(tmp_path, base):
    model = art.TrainableModel(name="agent", project="p", base_model=base)
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        start = weights(model.store.checkpoint_path(0))
        trainer = backend.trainer_of(model)
        original, calls = trainer.train_sft, []

        def fail_on_the_second_batch(*args, **kw):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("out of memory (simulated)")
            return original(*args, **kw)

        trainer.train_sft = fail_on_the_second_batch
        with pytest.raises(RuntimeError, match="simulated"):
            await model.train_sft(EXAMPLES, TrainSFTConfig(learning_rate=1e-2, batch_size=2))
        trainer.train_sft = original
        assert len(calls) == 2  # the first batch did update the weights in memory; they were put back
        assert same(trainer_state(backend, model), start)

        # cancelled while waiting for a running step: it never starts (the running one then fails)
        entered, go_on, started = threading.Event(), threading.Event(), []

        def blocked(*args, **kw):
            started.append(1)
            entered.set()
            go_on.wait(60)
            raise RuntimeError("stopped (simulated)")

        trainer.train_sft = blocked
        running = asyncio.create_task(model.train_sft(EXAMPLES))
        assert await asyncio.to_thread(entered.wait, 60)
        queued = asyncio.create_task(model.train_sft(EXAMPLES))
        await asyncio.sleep(0.1)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        go_on.set()
        with pytest.raises(RuntimeError, match="simulated"):
            await running
        trainer.train_sft = original
        assert started == [1]

        # refused before anything happens: wrong types, no data, a learning rate per batch that does not fit
        with pytest.raises(TypeError, match="takes art.Trajectory objects, got dict"):
            await model.train_sft([{"messages": []}])
        with pytest.raises(art.NothingToTrainError, match="got no trajectories.*nothing was written"):
            await model.train_sft([])
        with pytest.raises(
            ValueError, match="learning_rate has 2 values, but the trajectories make 3 batches"
        ):
            await model.train_sft(EXAMPLES, TrainSFTConfig(learning_rate=[1e-3, 1e-3], batch_size=2))
        with pytest.raises(ValueError, match=r"trajectory 1 has no assistant message"):
            await model.train_sft(
                [EXAMPLES[0], art.Trajectory(messages_and_choices=[{"role": "user", "content": "?"}])]
            )
        with pytest.warns(UserWarning, match="dropped 5 SFT sequences"):
            with pytest.raises(
                art.NothingToTrainError, match="all 5 sequences were longer than max_seq_length=16"
            ):
                await model.train_sft(EXAMPLES, _config={"max_seq_length": 16})

        assert await model.get_step() == 0 and model.store.steps() == [0] and model.history().empty
        assert not (tmp_path / "p/models/agent/trajectories").exists()
        assert same(trainer_state(backend, model), start)
        assert not (await backend.engine_of(model).stats())["held"]
        assert (await model.train_sft(EXAMPLES)).step == 1  # and the next step works


async def test_train_sft_from_file(tmp_path, base):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"messages": t.messages()}) + "\n" for t in EXAMPLES))
    model = art.TrainableModel(name="agent", project="p", base_model=base)
    async with art.LocalBackend(path=tmp_path / "art", engine="hf") as backend:
        await model.register(backend)
        rates = record_learning_rates(backend, model)
        result = await train_sft_from_file(model, str(path), epochs=2, batch_size=2, peak_lr=1e-2)
        # 5 examples x 2 epochs = 5 batches of 2, on one linear schedule with int(0.5) = 0 warm-up steps
        assert rates == pytest.approx(create_lr_schedule(5, 1e-2, "linear"))
        assert result.step == 1 and model.history().iloc[0]["data/num_trajectories"] == 10
        sources = {t.metadata["source"] for g in model.store.read_trajectories("train", 0) for t in g}
        assert sources == {f"train.jsonl:{n}" for n in range(1, 6)}

        # batches 3.. of the same schedule; past the end nothing happens
        await train_sft_from_file(model, str(path), epochs=2, batch_size=2, peak_lr=1e-2, initial_step=3)
        assert rates[5:] == pytest.approx(create_lr_schedule(5, 1e-2, "linear")[3:])
        assert await train_sft_from_file(model, str(path), epochs=2, batch_size=2, initial_step=5) is None

        # a bad line stops everything before training, naming the line
        path.write_text(path.read_text() + '{"messages": [{"role": "user", "content": "no reply"}]}\n')
        with pytest.raises(ValueError, match="train.jsonl:6: has no assistant message"):
            await train_sft_from_file(model, str(path))
        assert await model.get_step() == 2 and len(model.history()) == 2


async def test_rl_after_sft_continues_from_the_sft_checkpoint(tmp_path, base):
    model = art.TrainableModel(name="agent", project="p", base_model=base)
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        await model.train_sft(EXAMPLES, TrainSFTConfig(learning_rate=1e-2, batch_size=2))
        groups = await gather(model, 0)  # two groups, each with something to learn
        result = await model.train(groups, learning_rate=1e-9)
        assert result.step == 2 and "train/loss" in result.metrics

    ckpt = model.store.checkpoint_path
    # a tiny RL update on top of the SFT weights, not on the untrained adapter
    assert same(weights(ckpt(2)), weights(ckpt(1)), atol=1e-6)
    assert not same(weights(ckpt(2)), weights(ckpt(0)), atol=1e-3)
    # AdamW started afresh for RL (as ART does): its step count restarted
    steps = {n: torch.load(ckpt(n) / "optimizer.pt", weights_only=True)["state"][0]["step"] for n in (1, 2)}
    assert (float(steps[1]), float(steps[2])) == (3.0, 1.0)

    # the same after a restart: the kind of the last update is read from the run directory
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        await model.train_sft(EXAMPLES[:2], TrainSFTConfig(learning_rate=1e-3, batch_size=2))
    assert float(torch.load(ckpt(3) / "optimizer.pt", weights_only=True)["state"][0]["step"]) == 1.0


async def test_register_with_an_adapter_directory_starts_from_its_weights(tmp_path, base):
    sft = art.TrainableModel(name="sft", project="p", base_model=base)
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await sft.register(backend)
        await sft.train_sft(EXAMPLES, TrainSFTConfig(learning_rate=1e-2))
        adapter = sft.store.checkpoint_path(1)
        assert adapter_directory(str(adapter)) == adapter and adapter_directory(base) is None
        assert resolve_base_model(str(adapter)) == resolve_base_model(base)

        rl = art.TrainableModel(name="rl", project="p", base_model=str(adapter))
        await rl.register(backend)
        start = rl.store.checkpoint_path(0)
        assert same(weights(start), weights(adapter))
        assert not same(weights(start), weights(sft.store.checkpoint_path(0)))
        assert torch.load(start / "optimizer.pt", weights_only=True)["state"] == {}  # a new run: fresh AdamW
        assert same(trainer_state(backend, rl), weights(adapter))
        assert "rl@0" in await served_names(rl)

        other = art.TrainableModel(name="r4", project="p", base_model=str(adapter), lora=art.LoRAConfig(r=4))
        with pytest.raises(ValueError, match="was trained with .*'r': 8.*this trainer has .*'r': 4"):
            await other.register(backend)

    config = json.loads((adapter / "adapter_config.json").read_text())
    moved = tmp_path / "moved"
    moved.mkdir()
    (moved / "adapter_config.json").write_text(
        json.dumps({**config, "base_model_name_or_path": "/nowhere/model"})
    )
    with pytest.raises(
        FileNotFoundError, match=r"moved is a LoRA adapter of '/nowhere/model', which is not here"
    ):
        resolve_base_model(str(moved))
    (moved / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": None}))
    with pytest.raises(ValueError, match="names no base_model_name_or_path"):
        resolve_base_model(str(moved))


FORMAT = re.compile(r"ANSWER: [A-Z]+")
TEACH = [
    ("What color is the sky on a clear day?", "BLUE"), ("Which animal says moo?", "COW"),
    ("What is the opposite of hot?", "COLD"), ("What do bees make?", "HONEY"),
    ("What is frozen water called?", "ICE"), ("Which planet do we live on?", "EARTH"),
    ("What is the capital of France?", "PARIS"), ("What fruit is yellow and curved?", "BANANA"),
    ("What do you call a baby dog?", "PUPPY"), ("What is the largest ocean?", "PACIFIC"),
    ("What color is grass?", "GREEN"), ("What is the opposite of up?", "DOWN"),
    ("Which season comes after winter?", "SPRING"), ("What is the first month of the year?", "JANUARY"),
    ("Which animal is known as the king of the jungle?", "LION"), ("What shape has three sides?", "TRIANGLE"),
]  # fmt: skip
HELD_OUT = [
    "What color is a ripe tomato?", "Which animal barks?", "What is the opposite of big?",
    "What is the capital of Italy?", "What do birds use to fly?", "Which month comes after March?",
    "What is the opposite of wet?", "What do you call a baby cat?",
]  # fmt: skip


@pytest.mark.slow
async def test_sft_teaches_the_embedded_model_an_answer_format(tmp_path):
    """Measured (2 cores, HF engine): 0/8 greedy replies in the format before, 7/8 after 8 steps at lr 1e-3."""

    async def format_rate(model) -> float:
        replies = await asyncio.gather(
            *(
                model.openai_client().chat.completions.create(
                    model=model.get_inference_name(),
                    messages=[{"role": "user", "content": q}],
                    max_tokens=8,
                    temperature=0,
                )
                for q in HELD_OUT
            )
        )
        hits = [bool(FORMAT.fullmatch(r.choices[0].message.content.strip())) for r in replies]
        return sum(hits) / len(hits)

    examples = [
        art.Trajectory(
            messages_and_choices=[
                {"role": "user", "content": q},
                {"role": "assistant", "content": f"ANSWER: {a}"},
            ]
        )
        for q, a in TEACH
    ]
    model = art.TrainableModel(name="format", project="p", base_model=art.models.DEFAULT)
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        before = await format_rate(model)
        result = await model.train_sft(examples * 2, TrainSFTConfig(learning_rate=1e-3, batch_size=4))
        after = await format_rate(model)
    assert result.metrics["train/num_gradient_steps"] == 8
    assert before <= 1 / 8 and after >= 0.75, (before, after)


async def test_log_metrics_false_and_arts_openai_client_config(tmp_path, base):
    """ART's train_sft(log_metrics=False): the step commits and is served, and no reporter (W&B, Trackio,
    Langfuse) is told; history.jsonl keeps its row (part of the commit), which artnb says once.
    ART's register(_openai_client_config=...): its engine_args join _internal_config's, the rest is reported."""
    from artnb.core import reporting

    told = []

    class Recorder:
        name, url = "recorder", None

        def log_row(self, model, row, groups, config):
            told.append(row["step"])

        def instrument(self, model, client):
            pass

        def close(self):
            pass

    reporting.register("test recorder", lambda model: Recorder(), metric_name="test_recorder")
    model = art.TrainableModel(
        name="agent",
        project="p",
        base_model=base,
        report_metrics=["test_recorder"],
        _internal_config={"engine_args": {"enforce_eager": False, "seed": 1}},
    )
    try:
        async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
            with pytest.warns(UserWarning, match="server_args.*choose their own host"):
                await model.register(
                    backend,
                    _openai_client_config={
                        "engine_args": {"enforce_eager": True},
                        "server_args": {"port": 1},
                    },
                )
            assert model.internal_config == {"engine_args": {"enforce_eager": True, "seed": 1}}
            with pytest.warns(UserWarning, match="log_metrics=False.*part of its commit"):
                result = await model.train_sft(EXAMPLES[:2], TrainSFTConfig(batch_size=2), log_metrics=False)
            assert result.step == 1 and model.store.steps() == [0, 1] and told == []
            await model.train_sft(EXAMPLES[:2], TrainSFTConfig(batch_size=2))
            assert told == [1], "with log_metrics (the default) the step is reported"
    finally:
        reporting._registry.pop("test recorder")
