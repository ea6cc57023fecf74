"""LocalBackend on vLLM, as `engine="auto"` picks it when vLLM imports: train, hot-load, hold, fall back.

Skipped where `import vllm` fails; the reason says how to install it.
"""

import asyncio
import threading

import pytest

import artnb as art
from artnb.backends.engines.hf.client import HFEngine
from artnb.backends.engines.vllm.client import VLLMEngine, vllm_import_error
from artnb.models import tiny

if (problem := vllm_import_error()) is not None:
    pytest.skip(f"LocalBackend on vLLM needs vLLM: {problem}", allow_module_level=True)

pytestmark = pytest.mark.slow
CHOICES = ["A", "B"]


async def pick(model: art.TrainableModel, seed: int, max_tokens: int = 2) -> art.Trajectory:
    messages = [{"role": "system", "content": "Answer A or B."}, {"role": "user", "content": "Which?"}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(),
        messages=messages,
        max_tokens=max_tokens,
        seed=seed,
        extra_body={"structured_outputs": {"choice": CHOICES}},
    )
    choice = completion.choices[0]
    traj = art.Trajectory(messages_and_choices=[*messages, choice])
    traj.reward = 1.0 if choice.message.content == "A" else 0.0
    return traj


async def test_auto_serves_on_vllm_trains_and_hot_loads(tmp_path):
    model = art.TrainableModel(name="agent", project="p", base_model=art.models.DEFAULT)
    async with art.LocalBackend(path=tmp_path, engine="auto", engine_options={"max_loras": 2}) as backend:
        await model.register(backend)
        engine = backend.engine_of(model)
        assert isinstance(engine, VLLMEngine) and engine.max_lora_rank == model.lora.r
        groups = await art.gather_trajectory_groups(
            art.TrajectoryGroup(pick(model, seed=g * 100 + i) for i in range(6)) for g in range(2)
        )
        if all(len({t.reward for t in g}) == 1 for g in groups):
            groups[0].trajectories[0].reward = 1 - groups[0].trajectories[0].reward  # keep one signal
        train = asyncio.create_task(model.train(groups, learning_rate=1e-3))
        while not (await engine.stats())["held"]:
            assert not train.done(), train
            await asyncio.sleep(0.01)
        during = [asyncio.create_task(pick(model, seed=900 + i)) for i in range(3)]
        result = await train
        assert result.step == 1 and result.metrics["train/num_trainable_tokens"] > 0
        replies = await asyncio.gather(*during)
        assert all(t.messages_and_choices[-1].message.content in CHOICES for t in replies)
        completion = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert completion.model == "agent@1"
        assert list(engine.adapters) == ["agent@0", "agent@1"]
        # two more steps: max_loras=2 keeps only the newest two adapters loaded
        for step in (1, 2):
            for g in groups:
                g.trajectories[0].reward, g.trajectories[1].reward = 1.0, 0.0
            assert (await model.train(groups, learning_rate=1e-3)).step == step + 1
        assert list(engine.adapters) == ["agent@2", "agent@3"]


async def test_auto_falls_back_to_hf_when_vllm_cannot_serve_the_model(tmp_path):
    # vLLM's CPU attention kernels do not run head_dim 16, the tiny model's
    model = art.TrainableModel(name="agent", project="p", base_model=tiny(hidden_size=64, num_layers=2))
    async with art.LocalBackend(path=tmp_path, engine="auto") as backend:
        with pytest.warns(
            UserWarning, match="(?s)vLLM could not serve .*head_dim.*Using the HF engine instead"
        ):
            await model.register(backend)
        assert isinstance(backend.engine_of(model), HFEngine)
        assert (await pick(model, seed=1)).messages_and_choices[-1].message.content in CHOICES


async def test_engine_options_the_engine_does_not_take_are_named(tmp_path):
    model = art.TrainableModel(name="agent", project="p", base_model=tiny(hidden_size=64, num_layers=2))
    backend = art.LocalBackend(path=tmp_path, engine="vllm", engine_options={"max_batch_size": 4})
    with pytest.raises(TypeError, match=r"\['max_batch_size'\] are not options of the vllm engine"):
        await model.register(backend)
    # the trainer's build (started first on a CPU) ended too: nothing builds a model behind the caller's back
    assert not [t for t in threading.enumerate() if t.name.startswith("artnb-trainer")]
    await backend.close()
