"""ART's import surface: every name in art_surface.SURFACE imports from the path ART users write."""

from __future__ import annotations

import importlib

import pytest
from art_surface import SURFACE


@pytest.mark.parametrize(("module", "name"), [(m, n) for m, n, _, _ in SURFACE])
def test_art_name_imports(module, name):
    assert getattr(importlib.import_module(module), name) is not None


def test_every_status_is_known():
    assert {status for _, _, status, _ in SURFACE} <= {"same", "mapped", "accepted"}
