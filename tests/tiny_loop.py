"""Rollouts for tests that train the tiny random model over real engines: answer A (reward 1) or B (reward 0),
constrained to those two letters, with every group given something to learn whatever the model samples."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from openai import AsyncOpenAI

import artnb as art


async def pick(client: AsyncOpenAI, model: art.TrainableModel, seed: int) -> art.Trajectory:
    """Answer A (reward 1) or B (reward 0): trivially learnable."""
    messages = [{"role": "system", "content": "Answer A or B."}, {"role": "user", "content": "Which?"}]
    completion = await client.chat.completions.create(
        model=model.get_inference_name(),
        messages=messages,
        max_tokens=2,
        seed=seed,
        extra_body={"guided_choice": ["A", "B"]},
    )
    choice = completion.choices[0]
    return art.Trajectory(
        messages_and_choices=[*messages, choice], reward=float(choice.message.content == "A")
    )


async def gather(model: art.TrainableModel, seed: int, client: AsyncOpenAI | None = None):
    client = client or model.openai_client()
    groups = await art.gather_trajectory_groups(
        art.TrajectoryGroup(pick(client, model, seed * 100 + g * 10 + i) for i in range(8)) for g in range(2)
    )
    for g in groups:  # every group has something to learn, whatever the tiny model samples
        g.trajectories[0].reward, g.trajectories[1].reward = 1.0, 0.0
    return groups


async def scenario_group(
    model: art.TrainableModel, scenario: int, config: dict | None
) -> art.TrajectoryGroup:
    """PipelineTrainer's rollout_fn: a group of 4 answers to `scenario` (seeded), the first two rewarded 1 and 0
    so every group has something to learn, each tagged with its scenario; `config["delay"]` seconds of "tool
    time" after sampling."""
    client = model.openai_client()
    group = await art.TrajectoryGroup(pick(client, model, scenario * 100 + i) for i in range(4))
    group.trajectories[0].reward, group.trajectories[1].reward = 1.0, 0.0
    for t in group.trajectories:
        t.metadata["scenario"] = scenario
    if config and config.get("delay"):
        await asyncio.sleep(config["delay"])
    return group


@contextlib.asynccontextmanager
async def tiny_model_served(path: Path, name: str) -> AsyncIterator[art.TrainableModel]:
    """A TrainableModel on the tiny random model, registered on a LocalBackend with the HF engine (a few seconds)."""
    model = art.TrainableModel(name=name, project="tests", base_model=art.models.tiny())
    async with art.LocalBackend(path=path, engine="hf") as backend:
        await model.register(backend)
        yield model
