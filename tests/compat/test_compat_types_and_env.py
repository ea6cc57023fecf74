"""ART's message types, trajectory-group exceptions, `.env` on import, and ServerlessBackend, as ART code uses them.

- `art.Messages` / `art.Tools` / `art.MessagesAndChoices` annotate what ART notebooks pass to the OpenAI client,
  importable from `art`, `art.types` and (the trajectory types) `art.trajectories`.
- `art.TrajectoryGroup(trajectories, exceptions=[raw_exception])`: ART records failed rollouts this way.
- `import art` loads a `.env` file (API keys) as ART does; here from the working directory up.
- `ServerlessBackend()` (W&B's hosted training) trains on this machine instead, and says so once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import artnb as art
from artnb import models
from artnb.core import ignored
from artnb.serverless.backend import ServerlessBackend
from artnb.trajectories import PydanticException, Trajectory, TrajectoryGroup
from artnb.types import Messages, MessagesAndChoices, Tools


def test_message_types_are_one_set_of_types_under_arts_paths():
    assert (Messages, Tools, MessagesAndChoices) == (art.Messages, art.Tools, art.MessagesAndChoices)
    assert (Trajectory, TrajectoryGroup) == (art.Trajectory, art.TrajectoryGroup)
    messages: art.Messages = [{"role": "user", "content": "hi"}]
    tools: art.Tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    trajectory = art.Trajectory(
        messages_and_choices=[*messages, {"role": "assistant", "content": "hello"}], tools=tools, reward=1.0
    )
    assert trajectory.messages()[0] == messages[0] and trajectory.tools == tools


def test_a_group_takes_raw_exceptions_and_keeps_their_type_message_and_traceback():
    try:
        raise TimeoutError("rollout 3 timed out")
    except TimeoutError as error:
        raw = error
    group = art.TrajectoryGroup(
        [art.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}], reward=0.0)],
        exceptions=[raw],
    )
    (record,) = group.exceptions
    assert isinstance(record, PydanticException)
    assert (record.type, record.message) == ("TimeoutError", "rollout 3 timed out")
    assert "raise TimeoutError" in record.traceback
    again = art.TrajectoryGroup.model_validate_json(group.model_dump_json())  # as read back from disk
    assert again.exceptions == group.exceptions


def test_import_loads_a_dotenv_from_the_working_directory_up_and_keeps_set_variables(tmp_path):
    (tmp_path / ".env").write_text("ARTNB_TEST_FROM_DOTENV=from-file\nARTNB_TEST_ALREADY_SET=from-file\n")
    work = tmp_path / "notebooks"
    work.mkdir()
    env = {**os.environ, "ARTNB_TEST_ALREADY_SET": "from-shell"}
    env.pop("ARTNB_TEST_FROM_DOTENV", None)
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, artnb; print(os.environ.get('ARTNB_TEST_FROM_DOTENV'), os.environ['ARTNB_TEST_ALREADY_SET'])",
        ],
        cwd=work,
        env={**env, "PYTHONPATH": str(Path(art.__file__).parents[1])},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert out.stdout.split() == ["from-file", "from-shell"]


async def test_serverless_backend_trains_here_and_says_so_once(tmp_path, monkeypatch):
    monkeypatch.setattr(ignored, "_reported", set())
    with pytest.warns(UserWarning, match="ServerlessBackend is accepted for ART compatibility but ignored"):
        backend = ServerlessBackend(api_key="wandb-key-not-used", path=str(tmp_path), engine="hf")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ServerlessBackend(path=str(tmp_path / "other"))  # a second one: no second report
    base = models.tiny(hidden_size=64, num_layers=2, seed=1)
    model = art.TrainableModel(name="agent-001", project="2048", base_model=base)
    async with backend:
        await model.register(backend)
        client = model.openai_client()
        trajectories = []
        for reward in (0.0, 1.0):
            messages: art.Messages = [{"role": "user", "content": "move?"}]
            reply = await client.chat.completions.create(
                model=model.get_inference_name(), messages=messages, max_tokens=3
            )
            trajectories.append(
                art.Trajectory(messages_and_choices=[*messages, reply.choices[0]], reward=reward)
            )
        result = await backend.train(model, [art.TrajectoryGroup(trajectories)], learning_rate=1e-3)
        assert result.step == 1 and await model.get_step() == 1
    assert (tmp_path / "2048" / "models" / "agent-001" / "checkpoints" / "0001").is_dir()  # ART's layout
