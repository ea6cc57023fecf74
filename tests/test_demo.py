"""`make demo`: a preflight verdict first, trains (step 0 on the preflight's games), then shows the base model
against the trained one on the same held-out games, greedy and sampled, with intervals and the paired
difference; with `--ruler`, trains on the offline LocalJudge's scores and says which judge scored."""

import re

import pytest

from artnb import models
from artnb.demo import DemoConfig, demo_judge, run_demo
from artnb.local_judge import LocalJudge


@pytest.fixture(scope="module")
def base() -> str:
    return models.tiny()


def small_demo(tmp_path, base: str, **options) -> DemoConfig:
    """One step of one group of 4 games on the tiny model and the HF engine."""
    return DemoConfig(
        steps=1,
        groups_per_step=1,
        group_size=4,
        base_model=base,
        path=str(tmp_path / "art"),
        report=str(tmp_path / "demo.html"),
        engine="hf",
        **options,
    )


async def test_the_demo_checks_trains_then_compares_base_and_trained_on_the_same_games(
    tmp_path, base, capsys
):
    rows = await run_demo(small_demo(tmp_path, base, eval_games=3, eval_samples=2))
    assert [r["step"] for r in rows] == [0]
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["step", "reward"])
    verdict = next(i for i, line in enumerate(lines) if line.startswith("preflight: "))
    assert verdict < header  # the verdict and its checks come before step 0
    assert "rollouts that finished: 4 of 4" in out[: out.index("\nstep")]
    comparison = out[out.index("base vs trained") :].splitlines()
    assert "the same 3 held-out games" in comparison[0]
    assert comparison[1] == "greedy (temperature 0):" and "sampled, 2 per game:" in comparison
    assert comparison[2].split()[:5] == ["metric", "base", "trained", "(step", "1)"]
    assert [line.split()[0] for line in comparison[3:6]] == ["reward", "win", "legal_move_rate"]
    assert comparison[-2].startswith("trained - base, reward on sampled games: ")
    assert re.search(r"games: [+-]\d\.\d{3} \[[+-]\d\.\d{3}, [+-]\d\.\d{3}\]", comparison[-2])
    html = (tmp_path / "demo.html").read_text()
    assert "greedy games" in html and "sampled games" in html and "trained (step 1)" in html


def test_the_demo_judge_is_offline_unless_a_hosted_one_is_given():
    assert demo_judge(DemoConfig()) is None
    assert demo_judge(DemoConfig(ruler=True)) == LocalJudge()
    assert demo_judge(DemoConfig(ruler=True, judge="openai/gpt-4o-mini")) == "openai/gpt-4o-mini"


async def test_a_judge_without_ruler_is_refused(tmp_path):
    with pytest.raises(ValueError, match="add --ruler"):
        await run_demo(DemoConfig(judge="openai/gpt-4o-mini", path=str(tmp_path / "art")))


async def test_the_ruler_demo_trains_on_the_local_judge_and_says_so(tmp_path, base, capsys):
    rows = await run_demo(small_demo(tmp_path, base, eval_games=0, ruler=True))
    assert "ruler_score" in rows[0] and "independent_reward" in rows[0]
    out = capsys.readouterr().out
    assert "training reward: RULER, judged by art.LocalJudge(method='digits'), offline" in out
    assert "first group: game reward beside the score of art.LocalJudge(method='digits'), offline" in out
    header = next(line.split() for line in out.splitlines() if line.split()[:2] == ["step", "reward"])
    assert header == ["step", "reward", "legal", "win", "ruler", "rollout_s", "train_s"]
    html = (tmp_path / "demo.html").read_text()
    assert "Training reward: RULER's scores, judged by art.LocalJudge(method=&#x27;digits&#x27;)" in html
    assert "mean game reward" in html and "mean RULER score" in html
