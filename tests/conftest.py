"""Fixtures shared across test folders. The JupyterLab/Playwright helpers themselves are in tests/browser.py."""

import pytest
from browser import start_lab


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server on 127.0.0.1 with a token, its config and state kept in tmp_path (see browser.py)."""
    with start_lab(tmp_path) as server:
        yield server
