"""One tiny random Llama served by LocalBackend(engine="hf") for all widget tests (a few seconds to start)."""

import pytest
from tiny_loop import tiny_model_served

import artnb as art
from artnb.tasks import tic_tac_toe


@pytest.fixture(scope="session")
async def served(tmp_path_factory):
    """A registered TrainableModel on a tiny model; tests share it (steps advance across tests)."""
    async with tiny_model_served(tmp_path_factory.mktemp("art"), "widgets") as model:
        yield model


@pytest.fixture(scope="session")
async def played_group(served):
    """A real group of 4 tic-tac-toe games (multi-turn, Choices with logprobs)."""
    groups = await art.gather_trajectory_groups(
        [art.TrajectoryGroup(tic_tac_toe.rollout(served, 7) for _ in range(4))]
    )
    return groups[0]
