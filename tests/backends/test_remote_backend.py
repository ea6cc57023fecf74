"""RemoteBackend against `artnb serve` on 127.0.0.1 with the tiny model: an ART-style loop through the proxied
OpenAI endpoint, the local mirror behind `model.history()` and RewardPlot, SFT and fork, a connection dropped
mid-train, and a server killed with -9 and restarted.

One server is shared by the file (each test uses its own project); the kill test restarts it. A TCP relay in
front of it cuts the connection (or kills the server) at the moment the train stream reports a given phase, so
the failure tests do not depend on timing.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path

import pandas as pd
import pytest
from openai import AsyncOpenAI
from test_server import KEY, serve_command, wait_for_health
from tiny_loop import gather, pick
from transformers import AutoTokenizer

import artnb as art
from artnb.backends.ports import free_port
from artnb.backends.remote import Backend, RemoteBackend, ServerUnavailableError
from artnb.core.contracts import Backend as BackendContract
from artnb.core.store import RunStore
from artnb.core.tokenize import tokenize_groups
from artnb.core.wire import dumps, groups_from_wire, groups_to_wire, loads
from artnb.models import tiny
from artnb.widgets import RewardPlot, TrainingPanel

BASE = tiny(hidden_size=64, num_layers=2, seed=1)
TRAIN = b'"phase":"train"'  # the stream's line when the step's trainer starts


class Server:
    """`artnb serve --engine hf` in a subprocess, on a fixed path and port so it can be killed and restarted."""

    def __init__(self, root: Path) -> None:
        self.path, self.log, self.port = root / "runs", root / "server.log", free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(
                serve_command(self.path, self.port, "--engine", "hf"),
                env={**os.environ, "ARTNB_API_KEY": KEY},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        wait_for_health(self.url, self.process, self.log)

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        self.process.wait(timeout=60)


class Relay:
    """A TCP relay to the server. `arm(marker, action)`: when the server's bytes contain `marker`, run `action`
    and cut every connection (the line with the marker is not passed on)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.marker: bytes | None = None
        self.action = None
        self.writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def arm(self, marker: bytes, action=None) -> None:
        self.marker, self.action = marker, action

    def cut(self) -> None:
        for writer in list(self.writers):
            writer.transport.abort()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self.writers |= {writer, up_writer}
        await asyncio.gather(self._pump(up_reader, writer, watch=True), self._pump(reader, up_writer))
        self.writers -= {writer, up_writer}

    async def _pump(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, watch: bool = False
    ) -> None:
        seen = b""
        try:
            while data := await source.read(65536):
                seen = (seen + data)[-4096:]
                if watch and self.marker is not None and self.marker in seen:
                    action, self.marker, self.action = self.action, None, None
                    if action is not None:
                        action()
                    self.cut()
                    return
                sink.write(data)
                await sink.drain()
        except OSError:
            pass
        finally:
            sink.transport.abort()

    async def close(self) -> None:
        self.cut()
        self.server.close()
        await self.server.wait_closed()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("remote"))
    server.start()
    yield server
    server.stop()


def test_a_remote_backend_is_a_backend_and_art_backend_makes_one(tmp_path):
    backend = RemoteBackend("http://gpu-box:7999", path=tmp_path)
    assert isinstance(backend, BackendContract) and "gpu-box" in repr(backend)
    art_style = Backend(base_url="http://gpu-box:7999")
    assert isinstance(art_style, RemoteBackend) and art_style.path.name == "gpu-box_7999"
    assert art_style.path.parent.name == ".art-remote"
    with pytest.raises(ValueError, match="server's address"):
        RemoteBackend("gpu-box:7999")


async def test_an_art_loop_trains_over_the_server_and_reads_the_mirror(server, tmp_path):
    backend = RemoteBackend(server.url, api_key=KEY, path=tmp_path / "mirror")
    model = art.TrainableModel(name="agent", project="loop", base_model=BASE)
    await model.register(backend)
    assert model.inference_base_url == f"{server.url}/models/loop/agent/v1" and model.inference_api_key == KEY
    assert await model.get_step() == 0

    # ART notebooks make their own client from the model's fields: it reaches the engine through the server too
    own = AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key)
    assert "agent@0" in [m.id for m in (await own.models.list()).data]
    groups = await gather(model, 0, client=own)
    tokenizer = AutoTokenizer.from_pretrained(BASE)
    sent = tokenize_groups(tokenizer, groups_from_wire(loads(dumps(groups_to_wire(groups)))))
    here = tokenize_groups(tokenizer, groups)
    assert [s.token_ids for s in sent.sequences] == [s.token_ids for s in here.sequences]

    result = await backend.train(model, groups, learning_rate=1e-2)
    assert result.step == 1 and result.metrics["train/num_trainable_tokens"] > 0
    # ART's loop logs the batch it trained on: merged into that step's record, not written twice
    await model.log(groups, split="train", metrics={**result.metrics, "custom": 7.0}, step=result.step)
    await model.log(await gather(model, 1), split="val")
    result = await model.train(await gather(model, 2), config=art.TrainConfig(learning_rate=1e-2))
    assert result.step == 2
    await model.log(await gather(model, 3), split="val")

    history = model.history()  # the mirror: the server's own history, row for row
    server_store = RunStore(server.path, "loop", "agent")
    pd.testing.assert_frame_equal(history, server_store.history())
    assert list(history[history["split"] == "train"]["step"]) == [0, 1]
    assert list(history[history["split"] == "val"]["step"]) == [1, 2]
    assert history.iloc[0]["train/custom"] == 7.0
    assert [len(g) for g in model.store.read_trajectories("train", 0)] == [8, 8]
    assert not model.store.checkpoints.exists()  # never copied
    assert RewardPlot(model).points == {"train": 2, "val": 2}

    val = history[history["split"] == "val"].set_index("step")["val/reward"]
    deleted = await model.delete_checkpoints("val/reward")
    assert deleted == [s for s in (0, 1, 2) if s not in {2, int(val.idxmax())}]
    assert server_store.steps() == sorted({2, int(val.idxmax())})

    # the server's warnings and errors reach the notebook, errors with their own type
    same = await gather(model, 4)
    for g in same:
        for t in g:
            t.reward = 0.5
    with pytest.warns(UserWarning, match="nothing to train on: .*equal"):
        assert "equal" in (await model.train(same, learning_rate=1e-2)).skipped
    with pytest.raises(art.NothingToTrainError, match="the batch is empty"):
        await model.train([], learning_rate=1e-2)
    with pytest.raises(TypeError, match="unknown training option"):
        await model.train(same, learning_rat=1e-2)  # fails here, before anything is sent

    base = model.as_base_model()  # the base model on the same engine, through the same proxy
    reply = await base.openai_client().chat.completions.create(
        model=base.get_inference_name(), messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert reply.choices[0].message is not None
    # streamed and legacy completions pass through the proxy as the engine sends them
    chunks = [
        c
        async for c in await base.openai_client().chat.completions.create(
            model=base.get_inference_name(),
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=32,
            stream=True,
            extra_body={"min_tokens": 32},
        )
    ]
    joined = art.openai.accumulate_chunks(chunks)
    # pieces, not one body. A chunk holds every token sampled since the last one was sent, so a few tokens of the
    # tiny model can all fit in one on a busy machine (seen with 4 in a CI-like run); 32 take several GIL switches.
    assert len(chunks) >= 2 and len(joined.choices[0].model_extra["token_ids"]) == 32
    text = await base.openai_client().completions.create(
        model=base.get_inference_name(), prompt="hi", max_tokens=3
    )
    assert len(text.choices[0].model_extra["token_ids"]) == 3
    await backend.close()


async def test_sft_and_fork_run_on_the_server(server, tmp_path):
    backend = RemoteBackend(server.url, api_key=KEY, path=tmp_path)
    student = art.TrainableModel(name="student", project="sft", base_model=BASE)
    await student.register(backend)
    examples = [
        art.Trajectory(
            messages_and_choices=[
                {"role": "user", "content": f"Say {w}"},
                {"role": "assistant", "content": w},
            ]
        )
        for w in ("yes", "no", "maybe", "yes")
    ]
    result = await student.train_sft(examples, art.TrainSFTConfig(batch_size=2, learning_rate=1e-3))
    assert result.step == 1 and result.metrics["train/num_gradient_steps"] == 2
    assert "train/sft_loss" in student.history()
    with pytest.raises(TypeError, match="unknown SFT option"):
        await backend.train_sft(student, examples, batch_sise=2)  # fails here, before anything is sent

    fork = art.TrainableModel(name="fork", project="sft", base_model=BASE)
    await fork.register(backend)
    assert await backend._experimental_fork_checkpoint(fork, from_model="student") == 1
    assert await fork.get_step() == 1
    with pytest.raises(ValueError, match="has trained already"):  # the server's error, same type here
        await backend._experimental_fork_checkpoint(fork, from_model="student")
    await backend.close()


async def test_warnings_raised_on_the_servers_trainer_thread_reach_the_notebook(server, tmp_path, capsys):
    """The trainer is built (and steps) on a thread of the server's own: what it warns of still reaches the
    caller, as the warnings of the request's own task do; and the caller is told which trainer it got."""
    backend = RemoteBackend(server.url, api_key=KEY, path=tmp_path)
    lora = art.LoRAConfig(r=2, target_modules=["q_proj", "v_proj", "gate_projj"])
    model = art.TrainableModel(name="typo", project="warnings", base_model=BASE, lora=lora)
    with pytest.warns(UserWarning, match=r"target_modules \['gate_projj'\] do not exist in LlamaForCausalLM"):
        await model.register(backend)
    assert (
        f"artnb: {server.url} trains typo with its PeftTrainer\n" in capsys.readouterr().out
    )  # no GPU: no placement
    await backend.close()


async def test_an_annealed_default_temperature_reaches_the_servers_engine(server, tmp_path):
    """ART's examples/remote_backend/remote_2048.py sets a temperature annealer before registering over
    `art.Backend(base_url=...)`: the server's engine samples at its value for requests that name none (here 0:
    greedy, so two rollouts agree with one that names 0), and a train moves it on."""
    backend = RemoteBackend(server.url, api_key=KEY, path=tmp_path)
    model = art.TrainableModel(name="annealed", project="warnings", base_model=BASE)
    model.set_temperature_annealer(art.LinearTemperatureAnnealer(start=0.0, end=2.0, steps=2))
    await model.register(backend)
    client = model.openai_client()
    ask = dict(model=model.get_inference_name(), messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
    greedy = (await client.chat.completions.create(**ask, temperature=0)).choices[0].message.content
    for _ in range(2):
        assert (await client.chat.completions.create(**ask)).choices[0].message.content == greedy
    await model.train(await gather(model, 0), learning_rate=1e-2)
    assert model.default_temperature == 2.0
    await backend.close()


async def test_a_chat_template_file_is_read_in_the_notebook_not_on_the_server(server, tmp_path, monkeypatch):
    """`_internal_config["chat_template_path"]` names a file of the notebook's machine (relative here, to the
    notebook's folder, which the server's is not): its text is what the server's engine renders with."""
    template = (
        "{% if greeting is defined %}{{ greeting }}{% endif %}"
        + AutoTokenizer.from_pretrained(BASE).chat_template
    )
    (tmp_path / "mine.jinja").write_text(template)
    monkeypatch.chdir(tmp_path)
    backend = RemoteBackend(server.url, api_key=KEY, path=tmp_path)
    model = art.TrainableModel(
        name="templated",
        project="templates",
        base_model=BASE,
        _internal_config={"chat_template_path": "mine.jinja", "chat_template_kwargs": {"greeting": "MARK"}},
    )
    await model.register(backend)
    reply = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    prompt = AutoTokenizer.from_pretrained(BASE).decode((reply.model_extra or {})["prompt_token_ids"])
    assert prompt.startswith("MARK<|im_start|>")
    await backend.close()


async def test_the_training_panel_drives_a_remote_model(server, tmp_path):
    backend = RemoteBackend(server.url, api_key=KEY, path=tmp_path)
    model = art.TrainableModel(name="agent", project="panel", base_model=BASE)
    await model.register(backend)

    async def rollout(model: art.TrainableModel, seed: int) -> art.Trajectory:
        return await pick(model.openai_client(), model, seed)

    async def first_wins(group: art.TrajectoryGroup) -> art.TrajectoryGroup:
        group.trajectories[0].reward, group.trajectories[1].reward = 1.0, 0.0
        return group

    panel = TrainingPanel(
        model, rollout, scenarios=lambda step: [step, step + 1], group_size=4, score=first_wins, steps=2
    )
    await panel.refresh()
    assert "engine: serving agent at step 0" in panel.status.value
    panel.run_button.click()
    await panel.wait()
    assert panel.step == 2 and "step <b>2</b>" in panel.status.value
    assert panel.plot.points["train"] == 2  # the plot reads the local mirror
    await backend.close()


async def test_a_dropped_connection_mid_train_says_the_step_may_have_committed(server, tmp_path):
    relay = Relay(server.port)
    backend = RemoteBackend(await relay.start(), api_key=KEY, path=tmp_path)
    model = art.TrainableModel(name="agent", project="drop", base_model=BASE)
    await model.register(backend)
    groups = await gather(model, 0)

    relay.arm(TRAIN)  # cut the connection when the server reports that the trainer started
    with pytest.raises(ServerUnavailableError) as failure:
        await backend.train(model, groups, learning_rate=1e-2)
    message = str(failure.value)
    assert "lost during train() of drop/agent" in message and "last phase seen: hold" in message
    assert "may have committed" in message and "await model.get_step()" in message

    # the trainer had started, so the step commits although its caller went away; get_step waits for it
    assert await model.get_step() == 1
    assert list(model.history()["step"]) == [0]
    result = await model.train(await gather(model, 1), learning_rate=1e-2)  # the next call reconnects
    assert result.step == 2
    await backend.close()
    await relay.close()


async def test_a_killed_server_restarts_and_training_resumes_from_its_step(server, tmp_path):
    relay = Relay(server.port)
    backend = RemoteBackend(await relay.start(), api_key=KEY, path=tmp_path)
    model = art.TrainableModel(name="agent", project="restart", base_model=BASE)
    await model.register(backend)
    groups = await gather(model, 0)

    relay.arm(TRAIN, server.kill)  # kill -9 the server as its trainer starts
    with pytest.raises(ServerUnavailableError, match="may have committed"):
        await backend.train(model, groups, learning_rate=1e-2)
    server.process.wait(timeout=30)
    with pytest.raises(ServerUnavailableError, match="no answer from the artnb server.*nothing was done"):
        await model.get_step()  # the relay, like an SSH tunnel, accepts the connection and drops it
    with pytest.raises(ServerUnavailableError, match="cannot reach the artnb server.*Nothing was sent"):
        await art.Model(name="judge", project="restart").register(RemoteBackend(server.url, path=tmp_path))

    server.start()  # same path, same port
    with pytest.warns(UserWarning, match="registering it again") as warned:
        groups = await gather(model, 1)  # 16 rollouts find the model unknown: it is registered again, once
    assert len([w for w in warned if "registering it again" in str(w.message)]) == 1
    step = await model.get_step()
    assert step == RunStore(server.path, "restart", "agent").latest_step()  # 0 or 1: the kill raced the step
    assert list(model.history().get("step", [])) == list(range(step))
    result = await model.train(groups, learning_rate=1e-2)
    assert result.step == step + 1
    assert list(model.history()["step"]) == list(range(step + 1))
    await backend.close()
    await relay.close()
