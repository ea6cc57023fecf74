"""Fixtures shared across test folders. The JupyterLab/Playwright helpers themselves are in tests/browser.py."""

from collections.abc import Iterator

import pytest
from browser import start_lab
from hosted import ScriptedModel


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server on 127.0.0.1 with a token, its config and state kept in tmp_path (see browser.py)."""
    with start_lab(tmp_path) as server:
        yield server


@pytest.fixture
def scripted() -> Iterator[type[ScriptedModel]]:
    """Make hosted models (`scripted(replies)`, see hosted.py); each server stops after the test."""
    made: list[ScriptedModel] = []

    def make(replies: list[str | int]) -> ScriptedModel:
        made.append(ScriptedModel(replies))
        return made[-1]

    yield make  # type: ignore[misc]
    for server in made:
        server.close()


@pytest.fixture(autouse=True)
def _costs_stay_in_their_test():
    """Judge costs that name no model wait in a process-wide ledger for the next history row (core/costs.py);
    each test starts with it empty, so one test's judge calls never appear in another's rows."""
    from artnb.core import costs

    costs.shared.drain()
    yield


def pytest_collection_modifyitems(config, items):
    """The tutorials first. `make test`'s two workers take whole files in collection order
    (`--no-loadscope-reorder`), and tests/notebooks is the longest file by far (nine notebooks, about 20 minutes):
    started first, it runs beside everything else; started late, it would run on alone at the end."""
    items.sort(key=lambda item: not item.nodeid.startswith("tests/notebooks/"))  # stable: the rest keep order
