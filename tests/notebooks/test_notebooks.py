"""Every tutorial runs top to bottom in quick mode, headless (nbclient), as a user's kernel would run it.

Each runs in its own temporary directory (its `./.art` run directory goes there). A failing cell fails the
test with the cell's traceback.

`ARTNB_DOCS_SCREENSHOTS=docs` also makes the README's picture of each tutorial (not in CI: about 5 minutes a
notebook on 2 cores): the notebook opens in JupyterLab, Run All Cells runs it in quick mode on the embedded
model, and its most telling output is saved as docs/notebooks/<name>.png. Every artnb panel in the page is
also saved under pytest's tmp dir (candidates/), with a picture of the whole page.
"""

import os
import shutil
from pathlib import Path

import nbformat
import pytest
from browser import chromium_page, needs_chromium, open_notebook, run_all, shoot
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
DOCS = os.environ.get("ARTNB_DOCS_SCREENSHOTS")

# The output each tutorial's picture shows: (CSS selector, which match in the page).
PICTURES = {
    "tic_tac_toe": (".artnb-training-panel", 0),  # after the run: reward plot and the last step's games
    "2048": (".artnb-training-panel", 0),
    "codenames": (".artnb-group-view", 0),  # the self-play groups, one per board, team and role
    "reward_debugging": (".artnb-ruler-comparison", 0),
    "temporal_clue": (".artnb-trained-tokens", 0),  # one answer's tokens as the trainer sees them
    "art_e": (".artnb-ruler-comparison", 0),  # the planted-answer reward beside RULER's
    "auto_rl": (".artnb-scenario-editor", 0),  # the generated scenarios, editable
    "mcp_rl": (".artnb-group-view", 0),  # agent runs: tool calls and the server's replies
    "langgraph_agent": (".artnb-group-view", 0),  # one run of the graph as the trainer sees it
}
PANELS = [
    ".artnb-training-panel",
    ".artnb-group-view",
    ".artnb-ruler-comparison",
    ".artnb-reward-plot",
    ".artnb-trained-tokens",
    ".artnb-scenario-editor",
]

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def quick_mode_env(monkeypatch):
    """Kernels import this checkout and take the offline path: the local judge, no hosted model, no Binder."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("ARTNB_LOW_MEMORY", raising=False)


def test_every_tutorial_is_tested():
    tutorials = {
        *("tic_tac_toe", "2048", "codenames", "reward_debugging", "temporal_clue", "art_e", "auto_rl"),
        *("mcp_rl", "langgraph_agent"),
    }
    assert {p.stem for p in NOTEBOOKS} == tutorials
    assert set(PICTURES) == {p.stem for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_in_quick_mode(path, tmp_path):
    book = nbformat.read(path, as_version=4)
    NotebookClient(
        book, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    errors = [o for c in book.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    assert (tmp_path / ".art").is_dir(), "the tutorial wrote its run directory where it runs"


@needs_chromium
@pytest.mark.skipif(not DOCS, reason="makes the docs' pictures: set ARTNB_DOCS_SCREENSHOTS=<dir> (not in CI)")
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_screenshot_in_jupyterlab(path, lab):
    from playwright.sync_api import expect

    shutil.copy(path, lab["root"] / path.name)  # the kernel's cwd is the lab's root, a fresh tmp dir
    out = Path(DOCS).resolve() / "notebooks"
    out.mkdir(parents=True, exist_ok=True)
    candidates = lab["tmp"] / "candidates"
    candidates.mkdir()
    with chromium_page({"width": 1400, "height": 1600}) as page:
        try:
            open_notebook(page, lab, path.name)
            run_all(page, timeout_ms=45 * 60_000)
            page.wait_for_timeout(2000)  # the last widget messages and plotly's first draw
            for selector in PANELS:
                for i in range(page.locator(selector).count()):
                    shoot(page, page.locator(selector).nth(i), candidates / f"{selector[7:]}-{i}.png")
            page.screenshot(path=str(lab["tmp"] / "page.png"), full_page=True)
            selector, index = PICTURES[path.stem]
            target = page.locator(selector).nth(index)
            expect(target).to_be_visible()
            for plot in target.locator(".js-plotly-plot").all():
                expect(plot.locator(".scatterlayer .point, .barlayer .point").first).to_be_visible()
            shoot(page, target, out / f"{path.stem}.png")
        except BaseException:
            page.screenshot(path=str(lab["tmp"] / "failure.png"), full_page=True)
            print(f"screenshot of the failure: {lab['tmp'] / 'failure.png'}")
            raise
    assert (lab["root"] / ".art").is_dir(), "the tutorial wrote its run directory where it runs"
