"""ART's tic-tac-toe notebook loop, in its own shape, on the embedded 135M model: free-form XML moves, no output
constraint, `backend.train` + `model.log(..., split="train")`, `delete_checkpoints` each step.

The game and rollout are ours (artnb/tasks/tic_tac_toe.py's Board), written the way ART's notebook plays: the
model answers `<move>B2</move>`, an unreadable or illegal move ends the game early with a negative reward.
"""

from __future__ import annotations

import math
import random
import xml.etree.ElementTree as ET

import pytest
from openai import AsyncOpenAI

import artnb as art
from artnb.local import LocalBackend
from artnb.tasks.tic_tac_toe import CELLS, Board

pytestmark = pytest.mark.slow

SYSTEM = (
    "You are a tic-tac-toe player. Return your move as an XML object with a single property 'move', like so: "
    "<move>A1</move>. Cells are 'A1' to 'C3'. You are the x symbol."
)


def apply_move(board: Board, content: str) -> None:
    try:
        square = ET.fromstring(content).text or ""
    except ET.ParseError:
        raise ValueError("invalid xml") from None
    if square not in CELLS or board.cells[CELLS.index(square)] != ".":
        raise ValueError(f"illegal move {square!r}")
    board.cells[CELLS.index(square)] = "x"


async def rollout(model: art.Model, step: int) -> art.Trajectory:
    board = Board()
    trajectory = art.Trajectory(messages_and_choices=[{"role": "system", "content": SYSTEM}], reward=0)
    client = AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key)
    moves = 0
    while board.winner() is None and not board.full():
        trajectory.messages_and_choices.append({"role": "user", "content": board.render()})
        completion = await client.chat.completions.create(
            model=model.get_inference_name(), messages=trajectory.messages(), max_completion_tokens=16
        )
        choice = completion.choices[0]
        trajectory.messages_and_choices.append(choice)
        try:
            apply_move(board, choice.message.content or "")
        except ValueError:
            trajectory.reward = -1 + math.log(moves + 1) / math.log(100)
            break
        moves += 1
        if board.winner() is None and not board.full():
            board.cells[random.choice(board.empty())] = "o"
    else:
        trajectory.reward = {"x": 1.0, "o": 0.0}.get(board.winner(), 0.5)
    trajectory.metrics["num_moves"] = moves
    return trajectory


async def test_art_tic_tac_toe_notebook_loop_on_the_embedded_model(tmp_path):
    backend = LocalBackend(path=str(tmp_path), engine="hf")
    model = art.TrainableModel(name="001-script", project="tic-tac-toe", base_model=art.models.DEFAULT)
    await model.register(backend)
    for i in range(await model.get_step(), 2):
        train_groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(model, i) for _ in range(8)) for _ in range(1)), pbar_desc="gather"
        )
        train_result = await backend.train(model, train_groups, learning_rate=1e-3)
        await model.log(train_groups, metrics=train_result.metrics, step=train_result.step, split="train")
        await model.delete_checkpoints()
    history = model.history()
    assert list(history["step"]) == [0, 1] and set(history["split"]) == {"train"}
    assert all(math.isfinite(r) for r in history["train/reward"])
    assert model.store.steps() == [2]  # no val/reward logged: only the latest checkpoint is kept
    await backend.close()


TEACH = [
    ("What colour is the sky?", "BLUE"),
    ("Which animal barks?", "DOG"),
    ("What do bees make?", "HONEY"),
    ("What is frozen water?", "ICE"),
    ("Which planet do we live on?", "EARTH"),
    ("What colour is grass?", "GREEN"),
    ("What do cows drink?", "WATER"),
    ("Which month comes first?", "JANUARY"),
]


async def test_sft_from_a_file_then_rl_from_the_sft_adapter(tmp_path):
    """ART's SFT notebooks' shape: write a JSONL file, `train_sft_from_file`, then RL starting from the adapter."""
    import json

    from artnb.utils.sft import train_sft_from_file

    with open(tmp_path / "train.jsonl", "w") as f:
        for question, answer in TEACH:
            messages = [
                {"role": "user", "content": question},
                {"role": "assistant", "content": f"ANSWER: {answer}"},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    backend = LocalBackend(path=str(tmp_path / ".art"), engine="hf")
    sft = art.TrainableModel(name="sft-format", project="sft-example", base_model=art.models.DEFAULT)
    await sft.register(backend)
    await train_sft_from_file(
        model=sft, file_path=str(tmp_path / "train.jsonl"), epochs=4, batch_size=4, peak_lr=2e-3
    )
    assert await sft.get_step() == 1 and sft.history().iloc[0]["train/num_gradient_steps"] == 8

    # RL from the SFT adapter, passed as base_model (ART's documented way to warm-start RL)
    rl = art.TrainableModel(
        name="rl-after-sft", project="sft-example", base_model=str(sft.store.checkpoint_path(1))
    )
    await rl.register(backend)

    async def answer(model: art.Model, question: str) -> art.Trajectory:
        messages = [{"role": "user", "content": question}]
        completion = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=messages, max_tokens=8
        )
        content = completion.choices[0].message.content or ""
        return art.Trajectory(
            messages_and_choices=[*messages, completion.choices[0]],
            reward=float(content.startswith("ANSWER:")),
        )

    groups = await art.gather_trajectory_groups(
        art.TrajectoryGroup(answer(rl, q) for _ in range(4)) for q, _ in TEACH[:2]
    )
    assert sum(t.reward for g in groups for t in g) > 0  # the SFT adapter's format carried over
    result = await backend.train(rl, groups, learning_rate=1e-3)
    await rl.log(groups, metrics=result.metrics, step=result.step, split="train")
    assert result.step == 1 and list(rl.history()["step"]) == [0]
    await backend.close()
