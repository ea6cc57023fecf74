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


def test_arts_utils_submodules_are_attributes_imported_on_first_use():
    """`art.utils.s3` etc. after only `import art`, as ART code reaches them; plotly, pandas and boto3 are
    imported when one is first used, not by `import artnb` (checked in a fresh interpreter)."""
    import subprocess
    import sys

    script = (
        "import sys, artnb as art\n"
        "assert not {'plotly', 'pandas', 'boto3'} & set(sys.modules), sorted({'plotly', 'pandas', 'boto3'} & set(sys.modules))\n"
        "names = 's3 benchmarking sft get_trajectory_messages get_repo_root_path benchmark_rollout'.split()\n"
        "assert [getattr(art.utils, n).__name__ for n in names] == ['artnb.utils.' + n for n in names]\n"
        "assert callable(art.utils.s3.pull_model_from_s3) and callable(art.utils.sft.train_sft_from_file)\n"
        "try:\n    art.utils.nothing_here\nexcept AttributeError as e:\n    assert 'nothing_here' in str(e)\n"
        "else:\n    raise SystemExit('no AttributeError')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_arts_exported_names_mean_artnbs_equivalents():
    import artnb as art
    from artnb.backends.engine_transport import EngineDiedError
    from artnb.core.sft import TrainSFTConfig

    assert art.LocalServingUnavailableError is EngineDiedError and issubclass(EngineDiedError, RuntimeError)
    assert art.ServerlessTrainResult is art.TrainResult
    metric = art.MetricDefinition(key="val/reward", title="Reward", description="mean reward", kind="score")
    assert metric.higher_is_better is None and metric.dashboard_default is False
    assert set(art.dev.TrainSFTConfig.__annotations__) == {*TrainSFTConfig.model_fields, "metric_logging"}
    config = art.dev.get_openai_server_config(
        "agent", "Qwen/Qwen2.5-0.5B", "vllm.log", config={"engine_args": {"enforce_eager": True}}
    )
    assert config == {"log_file": "vllm.log", "engine_args": {"enforce_eager": True}}
    assert art.dev.get_openai_server_config("a", "b", "x.log", config={"log_file": "y.log"}) == {
        "log_file": "y.log"
    }
