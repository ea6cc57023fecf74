"""`import artnb` itself: cheap (public names are imported on first use), yet every public name, ART's aliases and
the package's modules are there for `art.X`, `from artnb import X`, `from artnb import *` and tab completion."""

from __future__ import annotations

import subprocess
import sys

import pytest

import artnb


def fresh(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_import_artnb_leaves_the_heavy_libraries_unimported():
    heavy = ("torch", "transformers", "pandas", "openai", "pyarrow")
    loaded = fresh(f"import sys, artnb; print([m for m in {heavy!r} if m in sys.modules])")
    assert loaded == "[]"
    # ...until a name that needs them is used
    assert fresh("import sys, artnb; artnb.TrainableModel; print('openai' in sys.modules)") == "True"


def test_every_public_name_resolves_and_star_import_gives_them():
    for name in artnb.__all__:
        assert getattr(artnb, name) is not None, name
    assert artnb.LocalTrainResult is artnb.TrainResult  # ART's alias
    names = {}
    exec("from artnb import *", names)
    assert set(artnb.__all__) <= set(names) and "TrainableModel" in names
    assert {"TrainableModel", "RemoteBackend", "widgets", "tasks"} <= set(dir(artnb))  # tab completion


def test_modules_are_attributes_and_an_unknown_name_says_so():
    from artnb.core import gather

    assert artnb.core.gather is gather and artnb.tasks.__name__ == "artnb.tasks"
    with pytest.raises(AttributeError, match="TrainableModle"):
        artnb.TrainableModle  # noqa: B018
