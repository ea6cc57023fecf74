"""JupyterLab on 127.0.0.1 driven by Playwright with Debian's Chromium, for the tests that need a real browser.

`start_lab(tmp_path)` runs a JupyterLab server with a token, its config, settings and state kept in tmp_path
(the `lab` fixture in tests/conftest.py wraps it); `open_notebook` loads a notebook in a page and waits for its
kernel; `run_cell`, `run_all` and `shoot` run cells and screenshot an output. Used by tests/widgets/ (the
panels) and tests/notebooks/ (the tutorials' docs pictures).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from artnb.backends.ports import free_port

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
REPO = Path(__file__).resolve().parents[1]

needs_chromium = pytest.mark.skipif(
    not Path(CHROMIUM).exists(),
    reason=f"no Chromium at {CHROMIUM}: `apt-get install chromium` (make test's setup does it) to run the browser test",
)

# Lab settings written before the server starts: no "get Jupyter news?" prompt over the outputs (the server
# has no outside network anyway), and every cell kept in the page (no windowing), so outputs far down a long
# notebook exist to be found and scrolled to.
SETTINGS = {
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
}


@contextlib.contextmanager
def start_lab(tmp_path: Path) -> Iterator[dict]:
    """A JupyterLab server on 127.0.0.1 with a token; notebooks go in (and kernels run in) tmp_path/root."""
    root = tmp_path / "root"
    root.mkdir()
    for name, values in SETTINGS.items():
        plugin = tmp_path / "settings" / f"{name}.jupyterlab-settings"
        plugin.parent.mkdir(parents=True, exist_ok=True)
        plugin.write_text(json.dumps(values))
    port, token = free_port(), secrets.token_hex(16)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
        "IPYTHONDIR": str(tmp_path / "ipython"),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    }
    log_path = tmp_path / "jupyterlab.log"
    log = open(log_path, "w")  # noqa: SIM115 (closed below)
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
            server.kill()
            log.close()
            pytest.fail("JupyterLab did not start:\n" + log_path.read_text()[-3000:])
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


@contextlib.contextmanager
def chromium_page(viewport: dict) -> Iterator:
    """A Playwright page in Debian's Chromium."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport=viewport)
        finally:
            browser.close()


def open_notebook(page, lab: dict, name: str) -> None:
    """Open `name` (relative to the lab's root) and wait until its kernel is idle; hide the file browser."""
    page.goto(f"{lab['base']}/lab/tree/{name}?token={lab['token']}")
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


def run_cell(page, index: int) -> None:
    page.evaluate(
        """async (i) => {
            const panel = window.jupyterapp.shell.currentWidget;
            panel.content.activeCellIndex = i;
            await window.jupyterapp.commands.execute('notebook:run-cell');
        }""",
        index,
    )


def run_all(page, timeout_ms: int) -> None:
    """Run > Run All Cells, then wait until every code cell has run and the kernel is idle.

    A cell that raises fails the test with its traceback (JupyterLab stops running the cells below it).
    """
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
    state = page.wait_for_function(
        """() => {
            const panel = window.jupyterapp.shell.currentWidget;
            const cells = panel.content.widgets.filter(c => c.model.type === 'code');
            for (const cell of cells) {
                for (const out of cell.model.outputs.toJSON()) {
                    if (out.output_type === 'error') {
                        return {error: (out.traceback || []).join('\\n'), source: cell.model.sharedModel.source};
                    }
                }
            }
            const kernel = panel.sessionContext.session.kernel;
            const done = cells.every(c => c.model.executionCount !== null && c.model.executionCount > 0);
            return done && kernel.status === 'idle' ? {error: null} : false;
        }""",
        timeout=timeout_ms,
        polling=2000,
    ).json_value()
    if state["error"] is not None:
        pytest.fail(f"a cell failed in JupyterLab:\n{state['source']}\n{_strip_ansi(state['error'])}")


def _strip_ansi(text: str) -> str:
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", text)


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
