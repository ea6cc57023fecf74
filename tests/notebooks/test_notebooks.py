"""Every tutorial runs top to bottom in quick mode, headless (nbclient), as a user's kernel would run it.

Each runs in its own temporary directory (its `./.art` run directory goes there). A failing cell fails the
test with the cell's traceback.
"""

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

pytestmark = pytest.mark.slow


def test_every_tutorial_is_tested():
    assert {p.stem for p in NOTEBOOKS} == {"tic_tac_toe", "2048", "codenames", "reward_debugging"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_in_quick_mode(path, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)  # the offline path: the local judge, no hosted model
    monkeypatch.delenv("ARTNB_LOW_MEMORY", raising=False)
    book = nbformat.read(path, as_version=4)
    NotebookClient(
        book, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    errors = [o for c in book.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    assert (tmp_path / ".art").is_dir(), "the tutorial wrote its run directory where it runs"
