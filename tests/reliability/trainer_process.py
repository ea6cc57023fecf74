"""A training process the reliability tests start, stop and kill: `python trainer_process.py RUN_DIR BASE MODE`.

MODE `kill:PHASE`: register, gather one batch, train one step, and SIGKILL itself (a real kill -9: no cleanup,
no atexit) the moment the backend logs that it enters PHASE. MODE `hold`: register, print REGISTERED, and keep
the run until stdin closes, then close the backend. `rollout` and `gather` are shared with the tests.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

import artnb as art

GROUPS, GROUP_SIZE = 2, 8


async def rollout(model: art.TrainableModel, seed: int, index: int) -> art.Trajectory:
    """One sampled answer; the reward varies with the index, so every group has something to learn."""
    messages = [{"role": "system", "content": "Answer A or B."}, {"role": "user", "content": "Which?"}]
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(),
        messages=messages,
        max_tokens=2,
        seed=seed,
        extra_body={"guided_choice": ["A", "B"]},
    )
    return art.Trajectory(messages_and_choices=[*messages, completion.choices[0]], reward=index / GROUP_SIZE)


async def gather(model: art.TrainableModel, seed: int) -> list[art.TrajectoryGroup]:
    return await art.gather_trajectory_groups(
        art.TrajectoryGroup(rollout(model, seed * 100 + g * 10 + i, i) for i in range(GROUP_SIZE))
        for g in range(GROUPS)
    )


class KillAt(logging.Handler):
    def __init__(self, phase: str) -> None:
        super().__init__(logging.DEBUG)
        self.phase = phase

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "artnb_phase", None) == self.phase:
            os.kill(os.getpid(), signal.SIGKILL)


async def main(run_dir: str, base: str, mode: str) -> None:
    model = art.TrainableModel(name="agent", project="p", base_model=base)
    backend = art.LocalBackend(path=run_dir, engine="hf")
    await model.register(backend)
    print("REGISTERED", flush=True)
    if mode == "hold":
        await asyncio.to_thread(sys.stdin.read)
    else:
        phase = mode.removeprefix("kill:")
        logger = logging.getLogger("artnb")
        logger.setLevel(logging.DEBUG)
        logger.addHandler(KillAt(phase))
        groups = await gather(model, seed=1)
        await model.train(groups, learning_rate=1e-2)
        print(f"finished without reaching {phase}", flush=True)
    await backend.close()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
