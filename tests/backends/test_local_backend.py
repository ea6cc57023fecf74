"""LocalBackend end to end on a tiny random model: register, serve, train, checkpoints, resume, failures."""

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import warnings

import openai
import pytest

import artnb as art
from artnb.core import ignored
from artnb.models import tiny

CHOICES = ["A", "B"]


async def pick(model: art.TrainableModel, seed: int, step: int | None = None) -> art.Trajectory:
    """A trivially learnable task: answer A (reward 1) or B (reward 0)."""
    client = model.openai_client()
    messages = [{"role": "system", "content": "Answer A or B."}, {"role": "user", "content": "Which?"}]
    completion = await client.chat.completions.create(
        model=model.get_inference_name(step),
        messages=messages,
        max_tokens=2,
        temperature=1.0,
        seed=seed,
        extra_body={"guided_choice": CHOICES},
    )
    choice = completion.choices[0]
    traj = art.Trajectory(messages_and_choices=[*messages, choice])
    traj.reward = 1.0 if choice.message.content == "A" else 0.0
    return traj


async def gather(model, step, groups=2, size=8):
    return await art.gather_trajectory_groups(
        art.TrajectoryGroup(pick(model, seed=step * 1000 + g * 100 + i) for i in range(size))
        for g in range(groups)
    )


@pytest.fixture(scope="module")
def base():
    return tiny(hidden_size=64, num_layers=2, seed=1)


async def test_register_train_resume(tmp_path, base):
    model = art.TrainableModel(name="agent", project="p", base_model=base)
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        assert await model.get_step() == 0
        assert (tmp_path / "p/models/agent/checkpoints/0000/adapter_model.safetensors").exists()
        groups = await gather(model, 0)
        result = await model.train(groups, config=art.TrainConfig(learning_rate=1e-2))
        assert result.step == 1 and await model.get_step() == 1
        assert result.checkpoint_path.endswith("checkpoints/0001")
        assert result.metrics["train/num_trainable_tokens"] > 0
        hist = model.history()
        assert list(hist["split"]) == ["train"] and hist.iloc[0]["step"] == 0
        assert (tmp_path / "p/models/agent/trajectories/train/0000.parquet").exists()
        served = await model.openai_client().models.list()
        assert "agent@1" in [m.id for m in served.data]
    # a new process (here: a new backend) resumes at the newest checkpoint and serves it
    model2 = art.TrainableModel(name="agent", project="p", base_model=base)
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model2.register(backend)
        assert await model2.get_step() == 1
        traj = await pick(model2, seed=1)
        assert traj.messages_and_choices[-1].message.content in CHOICES


async def test_a_run_refuses_another_base_model_or_lora_shape_and_keeps_its_record(tmp_path, base):
    model = art.TrainableModel(name="agent", project="p", base_model=base)
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        await model.train(await gather(model, 0), config=art.TrainConfig(learning_rate=1e-2))
    record = tmp_path / "p/models/agent/model.json"
    before = record.read_text()
    others = {  # each would load step 1's adapter onto what it was not trained for
        "base_model": tiny(hidden_size=64, num_layers=2, seed=2),  # the same shapes, other weights
        "lora.r": art.LoRAConfig(r=16),
    }
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        for changed, value in others.items():
            other = art.TrainableModel(
                name="agent",
                project="p",
                **({"base_model": value} if changed == "base_model" else {"base_model": base, "lora": value}),
            )
            with pytest.raises(
                ValueError, match=rf"other settings: {re.escape(changed)} .*nothing was loaded"
            ):
                await other.register(backend)
            assert record.read_text() == before
        again = art.TrainableModel(name="agent", project="p", base_model=base)
        await again.register(backend)  # the run's own settings still resume it
        assert await again.get_step() == 1
    assert json.loads(record.read_text())["chat_rendering"] == {
        "chat_template_sha256": None,
        "chat_template_kwargs": {},
    }
    # another rendering is allowed (a template fix is a fair reason) but said, and then recorded
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        kwargs = {"enable_thinking": False}
        rendered = art.TrainableModel(
            name="agent", project="p", base_model=base, _internal_config={"chat_template_kwargs": kwargs}
        )
        with pytest.warns(
            UserWarning, match=r"model's own chat template and chat_template_kwargs \{\} up to step 1"
        ):
            await rendered.register(backend)
        assert await rendered.get_step() == 1
    assert json.loads(record.read_text())["chat_rendering"]["chat_template_kwargs"] == kwargs


async def test_run_name_names_a_new_run_served_under_the_same_name(tmp_path, base):
    """ART 0.5.2x: `name` is what the model is served as, `run_name` the run (its directory, W&B run); a new
    run_name starts a fresh run beside an older run of the same name, which is left as it is."""
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        first = art.TrainableModel(name="agent", project="p", base_model=base)
        await first.register(backend)
        await first.train(await gather(first, 0), config=art.TrainConfig(learning_rate=1e-2))
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        model = art.TrainableModel(name="agent", run_name="exp-2", project="p", base_model=base)
        with pytest.warns(
            UserWarning, match=r"run_name='exp-2' starts a new run .*models/agent \(at step 1\)"
        ):
            await model.register(backend)
        assert await model.get_step() == 0 and model.get_inference_name() == "agent"
        groups = await gather(model, 0)  # served under "agent", from the new run's adapter
        await model.train(groups, config=art.TrainConfig(learning_rate=1e-2))
        await model.log(groups, split="val")
    assert (await model.get_step(), model.storage_name) == (1, "exp-2")
    assert sorted(p.name for p in (tmp_path / "p/models/exp-2/checkpoints").iterdir()) == ["0000", "0001"]
    assert list(model.history()["split"]) == ["train", "val"]
    assert sorted(p.name for p in (tmp_path / "p/models/agent/checkpoints").iterdir()) == ["0000", "0001"]
    assert len(first.history()) == 1  # the older run's history is its own
    with pytest.raises(ValueError, match="run_name='a/b' is not allowed"):
        art.TrainableModel(name="agent", run_name="a/b", project="p", base_model=base)


async def test_inference_waits_during_training_and_gets_the_new_adapter(tmp_path, base):
    model = art.TrainableModel(name="agent", project="p", base_model=base)
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        groups = await gather(model, 0)
        train = asyncio.create_task(model.train(groups, learning_rate=1e-2))
        engine = backend.engine_of(model)
        while not (await engine.stats())["held"]:  # the trainer is running: the engine holds requests
            assert not train.done(), train
            await asyncio.sleep(0.01)
        client = model.openai_client()
        replies = await asyncio.gather(
            *(
                client.chat.completions.create(
                    model=model.get_inference_name(),
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=3,
                )
                for _ in range(6)
            )
        )
        result = await train
        assert result.step == 1
        assert len(replies) == 6 and all(r.choices[0].message is not None for r in replies)
        assert {r.model for r in replies} == {"agent@1"}


async def test_concurrent_train_calls_run_one_after_the_other(tmp_path, base):
    model = art.TrainableModel(name="agent", project="p", base_model=base)
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        g1, g2 = await gather(model, 0), await gather(model, 1)
        r1, r2 = await asyncio.gather(
            model.train(g1, learning_rate=1e-3), model.train(g2, learning_rate=1e-3)
        )
        assert sorted([r1.step, r2.step]) == [1, 2]
        assert sorted(model.history()["step"]) == [0, 1]


async def test_equal_rewards_advance_the_step_but_nothing_at_all_does_not(tmp_path, base):
    model = art.TrainableModel(name="agent", project="p", base_model=base)
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        groups = await gather(model, 0)
        for g in groups:
            for t in g:
                t.reward = 0.5
        with pytest.warns(UserWarning, match="nothing to train on: .*equal"):
            result = await model.train(groups, learning_rate=1e-2)
        assert result.step == 1 and result.metrics["train/skipped"] == 1 and "equal" in result.skipped
        assert "agent@1" in [m.id for m in (await model.openai_client().models.list()).data]
        assert len(model.store.read_trajectories("train", 0)) == 2  # the measured rollouts are kept

        # no data at all is an error, and changes nothing: an empty batch, or every sequence over length
        with pytest.raises(art.NothingToTrainError, match="empty.*did not advance"):
            await model.train([], learning_rate=1e-2)
        groups = await gather(model, 1)
        groups[0].trajectories[0].reward = 1.0
        with pytest.warns(UserWarning, match="max_seq_length"):
            with pytest.raises(
                art.NothingToTrainError, match="no sampled token within their first max_seq_length"
            ):
                await model.train(groups, learning_rate=1e-2, max_seq_length=16)
        assert await model.get_step() == 1 and len(model.history()) == 1
        assert model.store.steps() == [0, 1]

        # unless asked: a skipped step is recorded in the history, without a checkpoint
        result = await model.train([], learning_rate=1e-2, on_nothing_to_train="skip")
        assert result.step == 1 and "empty" in result.skipped
        assert model.store.steps() == [0, 1]
        assert list(model.history()["train/skipped"]) == [1, 1]


async def test_bad_batches_fail_before_anything_changes(tmp_path, base):
    model = art.TrainableModel(name="agent", project="p", base_model=base)
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        groups = await gather(model, 0)
        groups[1].trajectories[3].reward = float("inf")
        with pytest.raises(ValueError, match="group 1, trajectory 3 has reward inf"):
            await model.train(groups, learning_rate=1e-2)
        lonely = art.TrajectoryGroup(groups[0].trajectories[:1])
        with pytest.raises(ValueError, match="1 trajectory"):
            await model.train([lonely], learning_rate=1e-2)
        with pytest.raises(TypeError, match="unknown training option"):
            await model.train(groups, learning_rte=1e-2)
        assert await model.get_step() == 0
        assert not (tmp_path / "p/models/agent/trajectories").exists()
        # a group that kept one rollout because the others failed (max_exceptions): left out, the rest trains
        failed = art.TrajectoryGroup(groups[0].trajectories[:1], exceptions=[RuntimeError("tool down")] * 7)
        with pytest.raises(art.NothingToTrainError, match="fewer than 2 finished rollouts"):
            with pytest.warns(UserWarning, match="left out"):
                await model.train([failed], learning_rate=1e-2)
        assert await model.get_step() == 0
        groups[1].trajectories[3].reward = 0.0
        with pytest.warns(UserWarning, match="group 0 has 1 finished rollout"):
            result = await model.train([failed, groups[1]], learning_rate=1e-2)
        assert result.step == 1 and result.metrics["data/num_groups_too_small"] == 1


def test_a_script_may_run_each_phase_in_its_own_asyncio_run(tmp_path, base):
    """register, rollouts + train, close: each in an asyncio.run of its own, as scripts do. The model's pooled
    connections belong to the loop that opened them; a later loop gets its own (close used to raise "Event
    loop is closed")."""
    model = art.TrainableModel(name="agent", project="p", base_model=base)
    backend = art.LocalBackend(path=tmp_path, engine="hf")
    asyncio.run(model.register(backend))

    async def step() -> int:
        result = await model.train(await gather(model, 0), learning_rate=1e-2)
        return result.step

    assert asyncio.run(step()) == 1
    assert asyncio.run(step()) == 2
    engine = backend.engine_of(model)
    asyncio.run(backend.close())
    assert not engine.alive()


def open_sockets() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except FileNotFoundError:  # the fd listdir itself used, closed since
            pass
    return count


async def test_a_dead_engine_is_restarted_by_the_next_call(tmp_path, base):
    model = art.TrainableModel(name="agent", project="p", base_model=base)
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        early_client = model.openai_client()  # as ART's notebooks keep it, from before any restart
        await pick(model, seed=2)
        sockets = open_sockets()
        for restart in range(2):
            engine = backend.engine_of(model)
            os.kill(engine.pid, signal.SIGKILL)
            for _ in range(100):
                if not engine.alive():
                    break
                await asyncio.sleep(0.05)
            with warnings.catch_warnings():
                traj = await pick(model, seed=3)  # restarts the engine, then answers
            assert traj.messages_and_choices[-1].message.content in CHOICES
            assert backend.engine_of(model).alive()
            # connections to the dead engine are closed, not kept (found leaking one socket a restart)
            assert open_sockets() == sockets, f"after restart {restart + 1}"
        listed = await early_client.models.list()  # an old client reaches the new engine
        assert "agent@0" in {m.id for m in listed.data}
        groups = await gather(model, 0)
        assert (await model.train(groups, learning_rate=1e-2)).step == 1


async def test_an_engine_that_cannot_restart_says_why_once(tmp_path, base, caplog):
    """The SDK retries what it takes for a lost connection: a restart that fails is answered (503, not to be
    retried) with its cause, instead of three more starts and "Connection error."."""
    weights = tmp_path / "model"
    shutil.copytree(base, weights)
    model = art.TrainableModel(name="agent", project="p", base_model=str(weights))
    async with art.LocalBackend(path=tmp_path / "runs", engine="hf") as backend:
        await model.register(backend)
        logs = model.store.logs
        starts = len(list(logs.glob("hf_engine_*.log")))
        (weights / "model.safetensors").rename(weights / "hidden")
        engine = backend.engine_of(model)
        os.kill(engine.pid, signal.SIGKILL)
        while engine.alive():
            await asyncio.sleep(0.05)
        with pytest.raises(
            openai.InternalServerError, match=r"could not be started .*exited with code 1"
        ) as error:
            await pick(model, seed=1)
        assert error.value.status_code == 503
        assert len(list(logs.glob("hf_engine_*.log"))) == starts + 1  # one try, not one per SDK retry
        (weights / "hidden").rename(weights / "model.safetensors")
        caplog.clear()
        traj = await pick(model, seed=1)  # fixed: the next request starts it
        assert traj.messages_and_choices[-1].message.content in CHOICES
        assert "the last try failed: RuntimeError" in caplog.text and "code -9" not in caplog.text


async def test_an_engine_start_that_takes_too_long_names_the_setting_that_gives_it_longer(tmp_path, base):
    model = art.TrainableModel(name="agent", project="p", base_model=base)
    slow = art.LocalBackend(path=tmp_path, engine="hf", engine_options={"start_timeout_s": 0.2})
    async with slow as backend:
        with pytest.raises(
            TimeoutError, match=r"(?s)not ready after 0.2s.*engine_options=\{'start_timeout_s': 600\}"
        ):
            await model.register(backend)
    with pytest.raises(ValueError, match=r"start_timeout_s=0: pass a positive number"):
        async with art.LocalBackend(
            path=tmp_path, engine="hf", engine_options={"start_timeout_s": 0}
        ) as backend:
            await model.register(backend)


async def test_an_engine_that_stops_answering_is_reported_while_a_request_waits(tmp_path, base, caplog):
    """ART's users saw gathers wait silently on a hung engine: a request waiting longer than `unanswered_s`
    has the engine's health checked, and one that does not answer is reported with its log."""
    model = art.TrainableModel(name="agent", project="p", base_model=base)
    options = {"unanswered_s": 1.0}
    async with art.LocalBackend(path=tmp_path, engine="hf", engine_options=options) as backend:
        await model.register(backend)
        await pick(model, seed=1)
        engine = backend.engine_of(model)
        os.kill(engine.pid, signal.SIGSTOP)  # as a hung process: alive, answering nothing
        try:
            waiting = asyncio.create_task(pick(model, seed=2))
            for _ in range(300):
                if "does not answer its health check" in caplog.text:
                    break
                await asyncio.sleep(0.05)
            assert not waiting.done()
        finally:
            os.kill(engine.pid, signal.SIGCONT)
        traj = await waiting  # it was left running: the request is answered once it runs again
        assert traj.messages_and_choices[-1].message.content in CHOICES
        assert "does not answer its health check" in caplog.text and str(engine.log_path) in caplog.text


async def test_reward_rises_on_a_trivially_learnable_task(tmp_path, base):
    model = art.TrainableModel(name="agent", project="p", base_model=base)
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        means = []
        for step in range(5):
            groups = await gather(model, step)
            means.append(sum(t.reward for g in groups for t in g) / 16)
            await model.train(groups, learning_rate=5e-2)
        final = await gather(model, 99)
        means.append(sum(t.reward for g in final for t in g) / 16)
    assert means[-1] >= means[0] + 0.3, means


async def test_groups_dropped_by_after_each_are_counted_in_the_history(tmp_path, base):
    model = art.TrainableModel(name="agent", project="p", base_model=base)

    async def judge(group: art.TrajectoryGroup) -> art.TrajectoryGroup:
        if group.metadata["g"] == 1:
            raise ConnectionError("judge unreachable")
        for i, t in enumerate(group):
            t.reward = float(i % 2)
        return group

    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        groups = await art.gather_trajectory_groups(
            (
                art.TrajectoryGroup((pick(model, seed=g * 10 + i) for i in range(4)), metadata={"g": g})
                for g in range(3)
            ),
            after_each=judge,
        )
        assert len(groups) == 2 and [f.group_index for f in groups.after_each_failures] == [1]
        await model.train(groups, learning_rate=1e-2)
        row = model.history().iloc[0]
        assert row["train/after_each_failures"] == 1 and row["train/num_trajectories"] == 8


def test_a_path_that_cannot_hold_runs_is_refused_when_the_backend_is_made(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(ValueError, match=r"afile is a file, not a directory.*pass a directory"):
        art.LocalBackend(path=afile / "runs")
    readonly = tmp_path / "ro"
    readonly.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(readonly)], capture_output=True
    )
    if mounted.returncode != 0:  # root ignores file modes: only a read-only mount shows the case
        pytest.skip(f"cannot mount a read-only tmpfs here ({mounted.stderr.decode().strip()})")
    try:
        with pytest.raises(
            ValueError, match=r"ro is not writable here.*pass a directory this process can write"
        ):
            art.LocalBackend(path=readonly / "runs")
    finally:
        subprocess.run(["umount", "-l", str(readonly)], check=False)


def test_arts_expert_replay_switch_is_accepted_and_true_is_reported(tmp_path, monkeypatch):
    """ART 0.5.23's `LocalBackend(enable_expert_replay=...)`: MoE routing replay in its Megatron trainer."""
    monkeypatch.setattr(ignored, "_reported", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        art.LocalBackend(path=tmp_path, enable_expert_replay=False)  # what artnb does: nothing to say
    with pytest.warns(UserWarning, match=r"enable_expert_replay=True\) is accepted .* no Megatron trainer"):
        art.LocalBackend(path=tmp_path, enable_expert_replay=True)


def test_trainer_config_takes_a_dict_of_its_fields_and_engine_options_must_be_a_dict(tmp_path):
    backend = art.LocalBackend(path=tmp_path, trainer_config={"gradient_checkpointing": True})
    assert backend.trainer_config == art.TrainerConfig(gradient_checkpointing=True)
    with pytest.raises(TypeError, match=r"engine_options=...\) takes a dict of engine settings.*got list"):
        art.LocalBackend(path=tmp_path, engine_options=[1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"trainer_config=...\) takes art.TrainerConfig"):
        art.LocalBackend(path=tmp_path, trainer_config=[1])  # type: ignore[arg-type]


async def test_an_older_checkpoint_on_disk_is_served_when_a_request_names_it(tmp_path, base):
    """After a restart the engine serves the newest step only; asking for a kept older one (the best by
    delete_checkpoints, say) loads it from the run directory, in both spellings, for many requests at once."""
    model = art.TrainableModel(name="agent", project="p", base_model=base)
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        for step in range(2):
            await model.train(await gather(model, step), learning_rate=1e-2)
    model = art.TrainableModel(name="agent", project="p", base_model=base)
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        served = [m.id for m in (await model.openai_client().models.list()).data]
        assert "agent@1" not in served
        client = model.openai_client()

        async def ask(name: str) -> str:
            completion = await client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "Which?"}], max_tokens=2
            )
            return completion.model

        assert await asyncio.gather(*(ask("agent@1") for _ in range(4))) == ["agent@1"] * 4
        assert await ask("agent:step1") == "agent@1"  # ART's spelling
        assert await ask("agent") == "agent@2"  # the newest stays the default
        with pytest.raises(openai.NotFoundError, match="agent@7"):  # a step not on disk stays an error
            await ask("agent@7")


async def test_loading_older_steps_never_leaves_the_plain_name_on_an_older_policy(tmp_path, base):
    """The engine keeps max_loras adapters and evicts the first loaded: older steps loaded on request may push
    the newest out, and the model's plain name must then load it again, not fall back to an older step."""
    model = art.TrainableModel(name="agent", project="p", base_model=base)
    async with art.LocalBackend(path=tmp_path, engine="hf", engine_options={"max_loras": 2}) as backend:
        await model.register(backend)
        for step in range(3):
            await model.train(await gather(model, step), learning_rate=1e-2)
        client = model.openai_client()

        async def ask(name: str) -> str:
            completion = await client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "Which?"}], max_tokens=2
            )
            return completion.model

        assert [await ask(f"agent@{step}") for step in (1, 0)] == ["agent@1", "agent@0"]
        assert await ask("agent") == "agent@3"
