"""Recorded trajectory groups shipped with the package, for places where rollouts cannot run (Binder's 2 GB).

`load("tic_tac_toe")` returns groups of real games the embedded model played (with the game's own reward), so
the reward-debugging tutorial can show the group view, RULER scores and the comparison without an engine
for rollouts. `record(...)` is how the file was made; rerun it to refresh it:

    python -m artnb.tasks.replay tic_tac_toe
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from ..core.store import RunStore
from ..core.trajectory import TrajectoryGroup

DATA = Path(__file__).with_name("data")
RECORDINGS = {"tic_tac_toe": "tic_tac_toe_groups.parquet"}


def path_of(name: str) -> Path:
    if name not in RECORDINGS:
        raise KeyError(f"no recording named {name!r}; recorded: {sorted(RECORDINGS)}")
    return DATA / RECORDINGS[name]


def load(name: str = "tic_tac_toe") -> list[TrajectoryGroup]:
    """The recorded groups (messages as plain dicts, rewards, metrics, logs), in recording order."""
    path = path_of(name)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing from this installation: reinstall artnb, or record it with "
            f"`python -m artnb.tasks.replay {name}`"
        )
    with tempfile.TemporaryDirectory() as tmp:
        store = RunStore(tmp, "replay", name)
        target = store.trajectories_path("replay", 0)
        target.parent.mkdir(parents=True)
        target.write_bytes(path.read_bytes())
        return store.read_trajectories("replay", 0)


async def record(name: str = "tic_tac_toe", groups: int = 4, group_size: int = 8) -> Path:
    """Play `groups` x `group_size` games with the embedded model (HF engine) and write them as the recording."""
    from .. import models
    from ..backends.local import LocalBackend
    from ..core.gather import gather_trajectory_groups
    from ..core.model import TrainableModel
    from . import tic_tac_toe

    path_of(name)
    with tempfile.TemporaryDirectory() as tmp:
        model = TrainableModel(name="recorder", project="replay", base_model=models.DEFAULT)
        async with LocalBackend(path=tmp, engine="hf") as backend:
            await model.register(backend)
            played = await gather_trajectory_groups(
                TrajectoryGroup(tic_tac_toe.rollout(model, seed) for _ in range(group_size))
                for seed in range(groups)
            )
        store = RunStore(tmp, "replay", name)
        written = store.write_trajectories("replay", 0, played)
        DATA.mkdir(exist_ok=True)
        path_of(name).write_bytes(written.read_bytes())
    return path_of(name)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="record trajectory groups for replay")
    parser.add_argument("name", choices=sorted(RECORDINGS))
    print(asyncio.run(record(parser.parse_args().name)))
