"""A PipelineTrainer run the kill test SIGKILLs mid-run: `python pipeline_process.py RUN_DIR BASE`.

Trains up to 20 steps of the tiny model with slow rollouts and one step of lag allowed; the test watches the
scenario position the trainer saves after each commit (state.json) and kills it while rollouts are in flight."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: tiny_loop

from tiny_loop import scenario_group  # noqa: E402

import artnb as art  # noqa: E402
from artnb.pipeline_trainer import PipelineTrainer  # noqa: E402

SETTINGS = dict(num_rollout_workers=4, min_batch_size=2, max_batch_size=2, max_steps_off_policy=1)


async def main(run_dir: str, base: str) -> None:
    model = art.TrainableModel(name="agent", project="p", base_model=base)
    async with art.LocalBackend(path=run_dir, engine="hf") as backend:
        await model.register(backend)
        trainer = PipelineTrainer(
            model,
            backend,
            scenario_group,
            range(1000),
            {"delay": 0.5},
            max_steps=20,
            learning_rate=1e-2,
            **SETTINGS,
        )
        await trainer.train()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
