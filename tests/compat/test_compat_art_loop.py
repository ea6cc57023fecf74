"""ART's loop, written the way ART's notebooks write it, runs on artnb with the tiny model.

The code below is ours, in the shape of ART's tic-tac-toe and Temporal Clue notebooks: `from artnb.local import
LocalBackend`, `model._internal_config = art.dev.InternalModelConfig(...)`, a rollout that builds its own
`AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key)`, XML moves, `@art.retry`,
`iterate_dataset`, `backend.train(...)` then `model.log(groups, metrics=result.metrics, step=result.step,
split="train")`, validation logged with `model.log(val_groups)`, `model.delete_checkpoints()`, a comparison
`art.Model` registered on the same backend, and ART's sync `with LocalBackend() as backend:`.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import openai
import pytest
from openai import AsyncOpenAI
from pydantic import BaseModel

import artnb as art
from artnb import models
from artnb.local import LocalBackend
from artnb.utils import iterate_dataset

MOVES = ["<move>A1</move>", "<move>B2</move>", "<move>C3</move>"]


class GameConfig(BaseModel):
    target: str = "B2"


class Scenario(BaseModel):
    step: int
    index: int


@pytest.fixture(scope="module")
def base() -> str:
    return models.tiny(hidden_size=64, num_layers=2, seed=1)


@art.retry(exceptions=(openai.LengthFinishReasonError,))
async def rollout(model: art.Model[GameConfig], scenario: Scenario) -> art.Trajectory:
    trajectory = art.Trajectory(
        messages_and_choices=[
            {"role": "system", "content": "Return your move as XML, like <move>A1</move>."},
            {"role": "user", "content": f"Game {scenario.index}: your move."},
        ],
        metadata={"notebook-id": "compat", "step": scenario.step},
        reward=0,
    )
    client = AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key)
    completion = await client.chat.completions.create(
        model=model.get_inference_name(),
        messages=trajectory.messages(),
        max_completion_tokens=12,
        extra_body={"guided_choice": MOVES},  # the tiny random model cannot write XML on its own
    )
    choice = completion.choices[0]
    trajectory.messages_and_choices.append(choice)
    move = ET.fromstring(choice.message.content).text
    trajectory.reward = 1.0 if move == model.config.target else 0.0
    trajectory.metrics["win"] = trajectory.reward
    return trajectory


async def test_art_notebook_loop_shape(tmp_path, base):
    backend = LocalBackend(in_process=True, path=str(tmp_path), engine="hf", enable_expert_replay=False)
    model = art.TrainableModel(name="001-script", project="tic-tac-toe", base_model=base, config=GameConfig())
    model._internal_config = art.dev.InternalModelConfig(
        init_args=art.dev.InitArgs(max_seq_length=512, load_in_4bit=True),
        engine_args=art.dev.EngineArgs(enforce_eager=True, gpu_memory_utilization=0.8),
    )
    with pytest.warns(UserWarning, match="load_in_4bit is accepted for ART compatibility but ignored"):
        await model.register(backend)
    scenarios = [Scenario(step=0, index=i) for i in range(4)]
    for batch in iterate_dataset(
        scenarios, groups_per_step=2, num_epochs=1, initial_step=await model.get_step()
    ):
        train_groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(model, s) for _ in range(4)) for s in batch.items),
            pbar_desc="gather",
            max_exceptions=0,
        )
        result = await backend.train(
            model,
            train_groups,
            learning_rate=1e-2,
            logprob_calculation_chunk_size=8,
            precalculate_logprobs=True,
            importance_sampling_level="sequence",
            normalize_advantages=False,
            kl_penalty_coef=0.01,
            verbose=True,
            optimizer_save_interval=5,  # ART 0.5.23's checkpoint keywords, which PipelineTrainer passes
            final_training_step=2,
        )
        # ART 0.5.23: await checkpoint_ready when set; here the checkpoint is committed when train returns
        assert result.checkpoint_ready is None and Path(result.checkpoint_path or "").is_dir()
        await model.log(train_groups, metrics=result.metrics, step=result.step, split="train")
        val_groups = await art.gather_trajectory_groups(
            [art.TrajectoryGroup(rollout(model, Scenario(step=batch.step, index=9)) for _ in range(2))]
        )
        await model.log(val_groups)
        await model.delete_checkpoints()

    assert await model.get_step() == 2
    history = model.history()
    train = history[history["split"] == "train"]
    assert list(train["step"]) == [0, 1]  # one row per step, not one more per model.log(..., split="train")
    lines = [json.loads(line) for line in model.store.history_path.read_text().splitlines()]
    assert [row["step"] for row in lines if row["split"] == "train"] == [0, 1]  # nothing written twice
    assert list(history[history["split"] == "val"]["step"]) == [1, 2]
    for step in (0, 1):
        assert sum(len(g) for g in model.store.read_trajectories("train", step)) == 8
    assert not model.store.trajectories_path("train", 2).exists()
    assert model.store.steps()[-1] == 2 and len(model.store.steps()) <= 2  # latest and best kept
    assert model.config.target == "B2" and '"target": "B2"' in (model.store.dir / "model.json").read_text()

    # a comparison model, served elsewhere (here: the same engine's base model), logs next to the trained one
    gpt = art.Model(
        name="gpt-4.1-mini",
        project="tic-tac-toe",
        inference_model_name=base,
        inference_base_url=model.inference_base_url,
        inference_api_key=model.inference_api_key,
    )
    await gpt.register(backend)
    await gpt.log(
        await art.gather_trajectory_groups(
            [art.TrajectoryGroup(rollout(model, scenarios[0]) for _ in range(2))]
        )
    )
    assert gpt.store.dir.parent == model.store.dir.parent and list(gpt.history()["step"]) == [0]
    await backend.close()


async def test_sync_with_and_fork(tmp_path, base):
    with LocalBackend(path=str(tmp_path), engine="hf") as backend:
        source = art.TrainableModel(name="source", project="p", base_model=base, config=GameConfig())
        await source.register(backend)
        groups = await art.gather_trajectory_groups(
            art.TrajectoryGroup(rollout(source, Scenario(step=0, index=i)) for _ in range(4))
            for i in range(2)
        )
        for (
            group
        ) in groups:  # something to learn whatever the tiny model sampled (equal rewards train nothing)
            group.trajectories[0].reward, group.trajectories[1].reward = 1.0, 0.0
        result = await source.train(groups, _config=art.dev.TrainConfig(learning_rate=1e-2, beta=0.01))
        assert result.metrics["train/kl"] >= 0  # beta is ART's name for the KL coefficient
        engine = backend.engine_of(source)

        fork = art.TrainableModel(name="fork", project="p", base_model=base, config=GameConfig())
        await fork.register(backend)
        assert await backend._experimental_fork_checkpoint(fork, from_model="source", not_after_step=5) == 1
        assert await fork.get_step() == 1
        reply = await fork.openai_client().chat.completions.create(
            model=fork.get_inference_name(), messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert reply.model == "fork@1"
        source_weights = (source.store.checkpoint_path(1) / "adapter_model.safetensors").read_bytes()
        assert (fork.store.checkpoint_path(1) / "adapter_model.safetensors").read_bytes() == source_weights
        with pytest.raises(ValueError, match="has trained already"):
            await backend._experimental_fork_checkpoint(fork, from_model="source")

        # ART's docs fork first, then register: the model starts from the forked step
        early = art.TrainableModel(name="early", project="p", base_model=base, config=GameConfig())
        assert await backend._experimental_fork_checkpoint(early, from_model="source") == 1
        await early.register(backend)
        assert await early.get_step() == 1
        assert (early.store.checkpoint_path(1) / "adapter_model.safetensors").read_bytes() == source_weights
        reply = await early.openai_client().chat.completions.create(
            model=early.get_inference_name(), messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert reply.model == "early@1"
    assert not engine.alive()  # the sync `with` stopped the engines
    # and released the runs: another backend may register them now
    async with LocalBackend(path=str(tmp_path), engine="hf") as again:
        await source.register(again)
        assert await source.get_step() == 1
