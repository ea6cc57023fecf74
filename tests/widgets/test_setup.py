"""`import artnb` stays light, `art.widgets` loads on first use, and Colab's widget manager is switched on."""

import os
import subprocess
import sys
import types
from pathlib import Path

import artnb.widgets

REPO = Path(__file__).resolve().parents[2]


def test_import_artnb_does_not_load_widget_libraries():
    code = (
        "import sys, artnb as art\n"
        "assert not {'ipywidgets', 'plotly'} & set(sys.modules), 'import artnb loaded widget libraries'\n"
        "assert art.widgets.TrainingPanel.__name__ == 'TrainingPanel' and 'ipywidgets' in sys.modules\n"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}
    )


def test_colab_custom_widget_manager_is_enabled_when_in_colab(monkeypatch):
    assert artnb.widgets.enable_colab_widgets() is False  # not in Colab here
    calls = []
    output = types.ModuleType("google.colab.output")
    output.enable_custom_widget_manager = lambda: calls.append("enabled")
    colab = types.ModuleType("google.colab")
    colab.output = output
    monkeypatch.setitem(sys.modules, "google", types.ModuleType("google"))
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    monkeypatch.setitem(sys.modules, "google.colab.output", output)
    assert artnb.widgets.enable_colab_widgets() is True and calls == ["enabled"]
