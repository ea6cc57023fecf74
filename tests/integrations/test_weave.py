"""Weave with artnb, as ART's notebooks use it: rollouts decorated with `@weave.op` train with Weave not
initialised; `init_weave` against a W&B server that is down or silent warns once, within its bound, and the loop
goes on; `strip_logprobs` as Weave's output hook keeps logprobs out of what Weave would send."""

from __future__ import annotations

import socket
import time
import warnings
from unittest.mock import MagicMock

import pytest
import weave
from openai.types.chat.chat_completion import Choice
from tiny_loop import pick
from weave.trace import weave_client
from weave.trace.context import weave_client_context

import artnb as art
from artnb.integrations.weave_init import init_weave
from artnb.models import tiny
from artnb.utils import strip_logprobs

BASE = tiny(hidden_size=64, num_layers=2, seed=1)


@weave.op
async def rollout(model: art.TrainableModel, seed: int) -> art.Trajectory:
    return await pick(model.openai_client(), model, seed)


async def train_a_step(model: art.TrainableModel) -> art.TrainResult:
    groups = await art.gather_trajectory_groups(
        art.TrajectoryGroup(rollout(model, 10 * g + i) for i in range(4)) for g in range(2)
    )
    assert all(isinstance(t, art.Trajectory) and t.trainable_turns() == 1 for g in groups for t in g)
    for g in groups:  # something to learn whatever the tiny model samples
        g.trajectories[0].reward, g.trajectories[1].reward = 1.0, 0.0
    return await model.train(groups, config=art.TrainConfig(learning_rate=1e-2))


@pytest.fixture(scope="module")
async def model(tmp_path_factory):
    backend = art.LocalBackend(path=tmp_path_factory.mktemp("weave"), engine="hf")
    model = art.TrainableModel(name="agent", project="weave", base_model=BASE)
    await model.register(backend)
    yield model
    await backend.close()


@pytest.fixture
def no_weave():
    assert weave_client_context.get_weave_client() is None
    yield
    weave_client_context.set_weave_client_global(None)


async def test_weave_ops_train_without_weave_init(no_weave, model):
    step = await model.get_step()
    assert (await train_a_step(model)).step == step + 1


@pytest.mark.parametrize("server", ["down", "silent"])
async def test_init_weave_without_a_reachable_server_warns_and_the_loop_goes_on(
    server, no_weave, monkeypatch, model
):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    if server == "silent":
        listener.listen(16)  # connections are queued, never answered
    port = listener.getsockname()[1]
    if server == "down":
        listener.close()
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        started = time.monotonic()
        client = init_weave("weave-down", timeout_s=2, global_postprocess_output=strip_logprobs)
        took = time.monotonic() - started
    assert client is None and took < 3
    [warning] = [str(w.message) for w in caught if "weave.init" in str(w.message)]
    assert f"127.0.0.1:{port}" in warning and "tracing is off" in warning
    assert ("within 2 s" if server == "silent" else "Connection refused") in warning

    step = await model.get_step()
    assert (await train_a_step(model)).step == step + 1
    listener.close()


def test_strip_logprobs_keeps_logprobs_out_of_weave_traces(no_weave):
    """Weave's own op and serialization code, with only its trace server replaced by a recording stub."""
    server = MagicMock()
    for method in (server.obj_create, server.file_create, server.table_create):
        method.return_value.digest = "digest"
    client = weave_client.WeaveClient(
        "entity", "project", server, ensure_project_exists=False, postprocess_output=strip_logprobs
    )
    weave_client_context.set_weave_client_global(client)
    token = {"token": "A", "logprob": -0.123, "bytes": [65], "top_logprobs": []}
    choice = Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": "A"},
            "logprobs": {"content": [token]},
        }
    )

    @weave.op
    def scored() -> art.Trajectory:
        return art.Trajectory(
            messages_and_choices=[{"role": "user", "content": "Which?"}, choice], reward=1.0
        )

    trajectory = scored()
    client.flush()
    assert trajectory.messages_and_choices[1].logprobs.content[0].logprob == -0.123  # training keeps them
    [end] = [c.args[0] for c in server.call_end.call_args_list]
    output = end["end"]["output"]
    assert "-0.123" not in repr(output) and "Which?" in repr(output)
