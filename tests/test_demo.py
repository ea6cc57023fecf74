"""`make demo`: trains, then shows the base model against the trained one on the same fixed games."""

import pytest

from artnb import models
from artnb.demo import DemoConfig, run_demo


@pytest.fixture(scope="module")
def base() -> str:
    return models.tiny()


async def test_the_demo_trains_then_compares_base_and_trained_on_the_same_games(tmp_path, base, capsys):
    cfg = DemoConfig(
        steps=1,
        groups_per_step=1,
        group_size=4,
        eval_games=3,
        base_model=base,
        path=str(tmp_path / "art"),
        report=str(tmp_path / "demo.html"),
        engine="hf",
    )
    rows = await run_demo(cfg)
    assert [r["step"] for r in rows] == [0]
    out = capsys.readouterr().out
    comparison = out[out.index("base vs trained") :].splitlines()
    assert "the same 3 games, greedy" in comparison[0]
    assert [line.split()[0] for line in comparison[2:4]] == ["base", "trained"]
    assert "trained (step 1)" in comparison[3]
    html = (tmp_path / "demo.html").read_text()
    assert "evaluation: same scenarios, each model" in html and "trained (step 1)" in html
