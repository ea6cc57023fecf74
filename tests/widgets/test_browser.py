"""The panels in a real browser: JupyterLab on 127.0.0.1, driven by Playwright with Debian's Chromium.

The test writes a notebook that registers a tiny model on LocalBackend(engine="hf") and shows a
TrainingPanel, runs it in JupyterLab, clicks "Train step" in the page and checks that the plot in the page
gained a point and the group view shows the new trajectories. Screenshots go to pytest's tmp dir.

`ARTNB_DOCS_SCREENSHOTS=docs` makes the docs' pictures instead (not in CI: ~2-5 minutes on 2 cores): the
embedded 135M model, two training steps, then a GroupView with a token view open, a RulerComparison judged by
the offline `art.LocalJudge()` and a RewardPlot read from disk, each saved as docs/<panel>.png.
"""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
from browser import chromium_page, needs_chromium, open_notebook, run_cell, shoot

DOCS = os.environ.get("ARTNB_DOCS_SCREENSHOTS")

pytestmark = needs_chromium

SETUP = """\
import artnb as art
from artnb.tasks import tic_tac_toe

model = art.TrainableModel(name="browser", project="panels", base_model={base_model})
backend = art.LocalBackend(path={path!r}, engine="hf")
await model.register(backend)"""

PANEL = """\
panel = art.widgets.TrainingPanel(
    model, tic_tac_toe.rollout, scenarios=lambda step: [step], group_size={group_size},
    train_config=art.TrainConfig(learning_rate=1e-3),
)
panel"""

DOCS_CELLS = [
    'view = art.widgets.GroupView(panel.loop.last_groups, arrangement="side by side")\nview',
    "judged = art.widgets.RulerComparison(\n"
    "    panel.loop.last_groups, judge=art.LocalJudge(),\n"
    '    rubric="A win is best, then a draw. A move on a taken cell is illegal and ends the game: worst.",\n'
    ")\njudged",
    'art.widgets.RewardPlot(model.store.dir, band="range")',
]


def write_notebook(root: Path) -> Path:
    base_model = "art.models.DEFAULT" if DOCS else "art.models.tiny()"
    cells = [
        SETUP.format(base_model=base_model, path=str(root / ".art")),
        PANEL.format(group_size=4 if DOCS else 2),
        *(DOCS_CELLS if DOCS else []),
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = root / "panels.ipynb"
    nbformat.write(nb, path)
    return path


def test_train_step_in_jupyterlab(lab):
    from playwright.sync_api import expect

    write_notebook(lab["root"])
    shots = Path(DOCS).resolve() if DOCS else lab["tmp"] / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    wait_ms = 900_000 if DOCS else int(os.environ.get("ARTNB_BROWSER_WAIT_S", "150")) * 1000
    with chromium_page({"width": 1400, "height": 1600 if DOCS else 1000}) as page:
        try:
            open_notebook(page, lab, "panels.ipynb")
            run_cell(page, 0)
            run_cell(page, 1)
            panel = page.locator(".artnb-training-panel")
            train = panel.get_by_role("button", name="Train step")
            expect(train).to_be_enabled(timeout=wait_ms)
            points = panel.locator(".artnb-reward-plot .scatterlayer .point")
            trajectories = panel.locator(".artnb-group-view .artnb-traj")
            expect(panel.locator(".artnb-reward-plot .js-plotly-plot")).to_be_visible(timeout=60_000)
            before = points.count()
            page.screenshot(path=str(lab["tmp"] / "before.png"))

            steps = 2 if DOCS else 1
            for step in range(steps):
                train.click()
                expect(train).to_be_disabled(timeout=10_000)
                expect(points).to_have_count(before + step + 1, timeout=wait_ms)
                expect(train).to_be_enabled(timeout=wait_ms)
            expect(trajectories).to_have_count(4 if DOCS else 2)
            expect(panel.locator(".artnb-group-view")).to_contain_text("trainable turn 1")
            expect(panel).to_contain_text(f"step {steps}")
            shoot(page, panel, shots / "training_panel.png")
            page.screenshot(path=str(lab["tmp"] / "after.png"))
            if DOCS:
                _docs_screenshots(page, shots, wait_ms)
        except BaseException:
            page.screenshot(path=str(lab["tmp"] / "failure.png"), full_page=True)
            print(f"screenshot of the failure: {lab['tmp'] / 'failure.png'}")
            raise


def _docs_screenshots(page, shots: Path, wait_ms: int) -> None:
    from playwright.sync_api import expect

    run_cell(page, 2)
    view = page.locator(".artnb-group-view").nth(1)
    expect(view.locator(".artnb-traj")).to_have_count(4, timeout=wait_ms)
    view.get_by_role("button", name="tokens of turn 1").first.click()
    expect(view.locator(".artnb-tok").first).to_be_visible()
    shoot(page, view, shots / "group_view.png")

    run_cell(page, 3)
    judged = page.locator(".artnb-ruler-comparison")
    judged.get_by_role("button", name="re-score").click()
    expect(judged).to_contain_text("scored by", timeout=wait_ms)
    shoot(page, judged, shots / "ruler_comparison.png")

    run_cell(page, 4)
    plot = page.locator(".artnb-reward-plot").nth(1)
    expect(plot.locator(".scatterlayer .point")).to_have_count(2, timeout=wait_ms)
    shoot(page, plot, shots / "reward_plot.png")
