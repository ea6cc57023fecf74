"""ART's small helpers under their ART import paths, as ART's example notebooks call them:
`get_trajectory_messages`, `get_repo_root_path` and `benchmark_rollout` (`pull_model_from_s3` is in
tests/backends/test_s3.py, beside an S3 server)."""

from __future__ import annotations

import json

from openai.types.chat.chat_completion import Choice

import artnb as art
from artnb.utils.benchmark_rollout import benchmark_rollout
from artnb.utils.get_repo_root_path import get_repo_root_path
from artnb.utils.get_trajectory_messages import get_trajectory_messages


def test_get_trajectory_messages_turns_choices_into_messages_with_their_tool_calls():
    call = {"id": "c1", "type": "function", "function": {"name": "move", "arguments": json.dumps({"to": 4})}}
    choice = Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "tool_calls",
            "message": {"role": "assistant", "content": "", "tool_calls": [call]},
        }
    )
    trajectory = art.Trajectory(messages_and_choices=[{"role": "user", "content": "Your move"}, choice])
    messages = get_trajectory_messages(trajectory)
    assert messages == trajectory.messages()
    assert messages[0] == {"role": "user", "content": "Your move"}
    assert messages[1]["role"] == "assistant" and messages[1]["tool_calls"][0]["function"]["name"] == "move"


def test_get_repo_root_path_is_the_working_directorys_repository(tmp_path, monkeypatch):
    (tmp_path / "repo" / ".git").mkdir(parents=True)
    (tmp_path / "repo" / "notebooks" / "deep").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "repo" / "notebooks" / "deep")
    assert get_repo_root_path() == str(tmp_path / "repo")
    monkeypatch.chdir(tmp_path)
    assert get_repo_root_path() == "."  # in no repository, as ART


async def test_benchmark_rollout_prints_and_returns_the_mean_reward(capsys):
    async def rollout(model: str, i: int, is_validation: bool) -> art.Trajectory:
        assert model == "gpt-4.1-mini" and not is_validation
        return art.Trajectory(messages_and_choices=[], reward=float(i))

    assert await benchmark_rollout("gpt-4.1-mini", 4, rollout) == 1.5
    assert "Average reward for gpt-4.1-mini: 1.5" in capsys.readouterr().out
