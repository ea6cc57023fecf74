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


def test_get_model_step_reads_the_newest_committed_checkpoint(tmp_path):
    from artnb.core.store import RunStore

    model = art.TrainableModel(name="agent", project="p", base_model="unused", base_path=str(tmp_path))
    assert art.utils.get_model_step(model) == 0, "a run that has not trained yet"
    store = RunStore(tmp_path, "p", "agent")
    for step in (1, 2):
        store.write_checkpoint(step, _write_adapter)
    (store.checkpoints / "0007").mkdir()  # no adapter files: not a committed checkpoint
    assert art.utils.get_model_step(model) == 2
    assert art.utils.get_model_step(model, art_path=tmp_path / "elsewhere") == 0


def _write_adapter(folder) -> None:
    from artnb.core.store import ADAPTER_FILES

    for name in ADAPTER_FILES:
        (folder / name).write_text("x")


def test_format_message_prints_role_content_and_tool_calls():
    call = {"id": "c", "type": "function", "function": {"name": "move", "arguments": '{"to": 4}'}}
    message = {"role": "assistant", "content": "Moving.", "tool_calls": [call]}
    assert art.utils.format_message(message) == 'Assistant:\nMoving.\nmove({"to": 4})'
    assert art.utils.format_message({"role": "user", "content": "Hi"}) == "User:\nHi"
    assert art.utils.format_message({"role": "assistant", "content": None, "tool_calls": [call]}) == (
        'Assistant:\nmove({"to": 4})'
    )


async def test_log_http_errors_puts_the_servers_detail_in_the_message():
    import httpx
    import pytest

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/json":
            return httpx.Response(422, json={"detail": "batch_size must be positive"})
        return httpx.Response(500, text="<html>oops</html>")

    @art.utils.log_http_errors
    async def call(path: str) -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer), base_url="http://s") as client:
            (await client.get(path)).raise_for_status()

    with pytest.raises(Exception, match=r"\[HTTP 422\] http://s/json batch_size must be positive") as info:
        await call("/json")
    assert isinstance(info.value.__cause__, httpx.HTTPStatusError)
    with pytest.raises(httpx.HTTPStatusError):  # not JSON: the original error
        await call("/html")


def test_record_provenance_appends_unless_it_is_already_the_last_entry():
    from artnb.utils.record_provenance import with_provenance

    assert with_provenance(None, "sft") == ["sft"]
    assert with_provenance(["sft"], "sft") == ["sft"]
    assert with_provenance(("sft",), "rl") == ["sft", "rl"]


def test_retry_is_reachable_by_arts_module_path():
    from artnb.utils.retry import retry

    assert retry is art.utils.retry is art.retry
