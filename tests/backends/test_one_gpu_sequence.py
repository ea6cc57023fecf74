"""One GPU for both: a step holds the engine (on CUDA vLLM also sleeps), trains, commits, frees the trainer's
cached memory, and only then loads the new adapter into the engine (waking it) and releases held requests.

Driven with the real CPU engines: the engine and trainer objects are the ones the backend built, and their
contract methods are wrapped only to record the order of the calls, which pass through unchanged. While the
trainer runs, the engine itself is asked whether it holds requests.
"""

import asyncio
import inspect

import pytest
from tiny_loop import gather

import artnb as art
from artnb import models

ENGINE_CALLS = ("hold", "load_adapter", "release")
TRAINER_CALLS = ("train", "save_checkpoint", "load_checkpoint", "free_memory")


def record(obj, names: tuple[str, ...], label: str, calls: list[str]) -> None:
    """Replace each method `names` of `obj` by one that appends "label.name" to `calls` and then calls it."""
    for name in names:
        method = getattr(obj, name)
        if inspect.iscoroutinefunction(method):

            async def wrapper(*args, _method=method, _name=name, **kwargs):
                calls.append(f"{label}.{_name}")
                return await _method(*args, **kwargs)
        else:

            def wrapper(*args, _method=method, _name=name, **kwargs):
                calls.append(f"{label}.{_name}")
                return _method(*args, **kwargs)

        setattr(obj, name, wrapper)


def watch_held_during_train(backend, model, held: list[bool]) -> None:
    """Ask the engine, from the trainer's thread as the step trains, whether it holds requests."""
    trainer, engine, loop = backend.trainer_of(model), backend.engine_of(model), asyncio.get_running_loop()
    train = trainer.train

    def train_and_ask(*args, **kwargs):
        held.append(asyncio.run_coroutine_threadsafe(engine.stats(), loop).result(timeout=60)["held"])
        return train(*args, **kwargs)

    trainer.train = train_and_ask


@pytest.fixture(params=["hf", pytest.param("vllm", marks=pytest.mark.slow)])
def engine_kind(request):
    if request.param == "vllm":
        from artnb.backends.engines.vllm.client import vllm_import_error

        if (problem := vllm_import_error()) is not None:
            pytest.skip(f"needs vLLM: {problem}")
    return request.param


async def test_hold_train_commit_free_then_hot_load_and_release(tmp_path, engine_kind):
    base = (
        models.tiny() if engine_kind == "hf" else models.DEFAULT
    )  # vLLM's CPU kernels reject the tiny model
    model = art.TrainableModel(name="agent", project="p", base_model=base)
    async with art.LocalBackend(path=tmp_path, engine=engine_kind, trainer="auto") as backend:
        await model.register(backend)
        groups = await gather(model, seed=0)
        calls: list[str] = []
        held: list[bool] = []
        watch_held_during_train(backend, model, held)
        record(backend.engine_of(model), ENGINE_CALLS, "engine", calls)
        record(backend.trainer_of(model), TRAINER_CALLS, "trainer", calls)
        result = await model.train(groups, learning_rate=1e-2)

        assert result.step == 1
        assert calls == [
            "engine.hold",  # requests wait (on CUDA: vLLM sleeps, freeing its weights and KV cache)
            "trainer.train",
            "trainer.save_checkpoint",  # the commit
            "trainer.free_memory",  # the trainer's cached memory back before the engine wakes
            "engine.load_adapter",  # the hot-load (on CUDA: wakes vLLM first)
            "engine.release",  # held requests run, on the new adapter
        ]
        assert held == [True]
        assert (await backend.engine_of(model).stats())["held"] is False
        reply = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert reply.model == "agent@1"


async def test_a_failed_train_still_frees_memory_before_the_engine_is_released(tmp_path):
    """A batch the trainer refuses (longer than the model's context, let through by TrainConfig.max_seq_length):
    the trainer goes back to the last checkpoint, frees its memory, and the engine is released without a
    hot-load."""
    model = art.TrainableModel(name="agent", project="p", base_model=models.tiny())
    async with art.LocalBackend(path=tmp_path, engine="hf") as backend:
        await model.register(backend)
        groups = await gather(model, seed=1)
        for group in groups:
            for trajectory in group.trajectories:
                trajectory.messages_and_choices[0] = {"role": "system", "content": "Answer A or B. " * 600}
        calls: list[str] = []
        record(backend.engine_of(model), ENGINE_CALLS, "engine", calls)
        record(backend.trainer_of(model), TRAINER_CALLS, "trainer", calls)
        with pytest.raises(ValueError, match="more than the model's context length"):
            await model.train(groups, learning_rate=1e-2, max_seq_length=8192)
        assert calls == [
            "engine.hold",
            "trainer.train",
            "trainer.load_checkpoint",  # back to checkpoint 0
            "trainer.free_memory",
            "engine.release",
        ]
        assert await model.get_step() == 0
        assert (await backend.engine_of(model).stats())["held"] is False
