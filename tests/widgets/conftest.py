"""One tiny random Llama served by LocalBackend(engine="hf") for all widget tests (a few seconds to start)."""

import pytest

import artnb as art
from artnb.tasks import tic_tac_toe


@pytest.fixture(scope="session")
async def served(tmp_path_factory):
    """A registered TrainableModel on a tiny model; tests share it (steps advance across tests)."""
    model = art.TrainableModel(name="widgets", project="tests", base_model=art.models.tiny())
    backend = art.LocalBackend(path=tmp_path_factory.mktemp("art"), engine="hf")
    await model.register(backend)
    yield model
    await backend.close()


@pytest.fixture(scope="session")
async def played_group(served):
    """A real group of 4 tic-tac-toe games (multi-turn, Choices with logprobs)."""
    groups = await art.gather_trajectory_groups(
        [art.TrajectoryGroup(tic_tac_toe.rollout(served, 7) for _ in range(4))]
    )
    return groups[0]
