"""The panels in a real browser: JupyterLab on 127.0.0.1, driven by Playwright with Debian's Chromium.

The test writes a notebook that registers a tiny model on LocalBackend(engine="hf") and shows a
TrainingPanel, runs it in JupyterLab, clicks "Train step" in the page and checks that the plot in the page
gained a point and the group view shows the new trajectories. Screenshots go to pytest's tmp dir.

`ARTNB_DOCS_SCREENSHOTS=docs` makes the docs' pictures instead (not in CI: ~2-5 minutes on 2 cores): the
embedded 135M model, two training steps, then a GroupView with a token view open, a RulerComparison judged by
the untrained base model and a RewardPlot read from disk, each saved as docs/<panel>.png.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
REPO = Path(__file__).resolve().parents[2]
DOCS = os.environ.get("ARTNB_DOCS_SCREENSHOTS")

pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(),
    reason=f"no Chromium at {CHROMIUM}: `apt-get install chromium` (make test's setup does it) to run the browser test",
)

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
    "    panel.loop.last_groups, judge=model.as_base_model(),\n"
    '    rubric="A win is best, then a draw. A move on a taken cell is illegal and ends the game: worst.",\n'
    ")\njudged",
    'art.widgets.RewardPlot(model.store.dir, band="range")',
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server on 127.0.0.1 with a token, its config and state kept in tmp_path."""
    root = tmp_path / "root"
    root.mkdir()
    # No "get Jupyter news?" prompt over the panels (the server has no outside network anyway).
    news = tmp_path / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    port, token = free_port(), secrets.token_hex(16)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
        "IPYTHONDIR": str(tmp_path / "ipython"),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    }
    log = open(tmp_path / "jupyterlab.log", "w")  # noqa: SIM115 (closed below)
    server = subprocess.Popen(
        [
            sys.executable, "-m", "jupyterlab", "--no-browser",
            "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
            f"--LabApp.user_settings_dir={tmp_path / 'settings'}", f"--LabApp.workspaces_dir={tmp_path / 'ws'}",
            "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.expose_app_in_browser=True", "--LabApp.extension_manager=readonly",
            "--ServerApp.terminals_enabled=False",
            *(["--allow-root"] if os.geteuid() == 0 else []),
        ],
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            log.close()
            pytest.fail("JupyterLab did not start:\n" + (tmp_path / "jupyterlab.log").read_text()[-3000:])
        time.sleep(0.5)
    try:
        yield {"root": root, "base": base, "token": token, "tmp": tmp_path}
    finally:
        _shutdown_kernels(base, token)
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def _shutdown_kernels(base: str, token: str) -> None:
    """Shut kernels down politely, so their inference engines stop with them."""
    try:
        with urllib.request.urlopen(f"{base}/api/kernels?token={token}", timeout=5) as r:
            kernels = json.load(r)
        for k in kernels:
            req = urllib.request.Request(f"{base}/api/kernels/{k['id']}?token={token}", method="DELETE")
            urllib.request.urlopen(req, timeout=20).close()
    except OSError:
        pass


def run_cell(page, index: int) -> None:
    page.evaluate(
        """async (i) => {
            const panel = window.jupyterapp.shell.currentWidget;
            panel.content.activeCellIndex = i;
            await window.jupyterapp.commands.execute('notebook:run-cell');
        }""",
        index,
    )


def shoot(page, locator, path: Path, max_height: int = 1500) -> None:
    """Screenshot an output, scrolled to the top of the notebook view and cut at `max_height` pixels."""
    locator.evaluate("e => e.scrollIntoView({block: 'start'})")
    page.wait_for_timeout(300)
    box = locator.bounding_box()
    bottom = page.viewport_size["height"] - 30  # above the status bar
    height = min(box["height"], max_height, bottom - box["y"])
    page.screenshot(
        path=str(path), clip={"x": box["x"], "y": box["y"], "width": box["width"], "height": height}
    )


def test_train_step_in_jupyterlab(lab):
    from playwright.sync_api import expect, sync_playwright

    write_notebook(lab["root"])
    shots = Path(DOCS).resolve() if DOCS else lab["tmp"] / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    wait_ms = 900_000 if DOCS else int(os.environ.get("ARTNB_BROWSER_WAIT_S", "150")) * 1000
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1600 if DOCS else 1000})
        try:
            page.goto(f"{lab['base']}/lab/tree/panels.ipynb?token={lab['token']}")
            page.wait_for_function(
                "() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                " && window.jupyterapp.shell.currentWidget.sessionContext?.session?.kernel",
                timeout=60_000,
            )
            page.wait_for_function(
                "() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status === 'idle'",
                timeout=60_000,
            )
            page.evaluate("() => window.jupyterapp.commands.execute('application:toggle-left-area')")
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
        finally:
            browser.close()


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
