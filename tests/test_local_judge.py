"""art.LocalJudge: an in-process RULER judge scoring from token probabilities. The contract is tested with a
tiny random model; what the embedded model can tell apart, and the measurement script, with the real one."""

import sys
from pathlib import Path

import pytest
import torch

import artnb as art
from artnb import models
from artnb.local_judge import _load, _next_token_logprobs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import judge_quality  # noqa: E402


@pytest.fixture(scope="module")
def base() -> str:
    return models.tiny()


def attempt(answer: str, question: str = "What is 2 + 2? Answer with a number.") -> art.Trajectory:
    return art.Trajectory(
        messages_and_choices=[
            {"role": "system", "content": "You answer arithmetic questions."},
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ],
        reward=0.0,
    )


@pytest.mark.parametrize("method", ["digits", "pairwise"])
async def test_every_trajectory_gets_a_score_in_0_1_and_copies_share_it(base, method):
    group = art.TrajectoryGroup([attempt("4"), attempt("5"), attempt("4"), attempt("twenty two")])
    scored = await art.ruler_score_group(group, art.LocalJudge(base, method=method))
    scores = [t.metrics["ruler_score"] for t in scored.trajectories]
    assert all(0 <= s <= 1 for s in scores) and min(scores) == 0 and max(scores) == 1
    assert scores[0] == scores[2]
    assert all(t.reward == t.metrics["ruler_score"] for t in scored.trajectories)
    assert all(t.metrics["independent_reward"] == 0.0 for t in scored.trajectories)
    assert all(t.metadata["ruler_explanation"] for t in scored.trajectories)
    assert [t.metrics for t in group.trajectories] == [{}] * 4, "the input group is left as it was"


async def test_a_single_trajectory_keeps_its_absolute_score(base):
    [score] = await art.ruler([attempt("4").messages()], art.LocalJudge(base))
    assert 0 <= score.score <= 1 and score.explanation.startswith("expected grade")


def test_the_shared_prefix_cache_gives_the_same_logprobs_as_whole_prompts(base):
    prompts = [
        "The task is to add. Attempt: 4",
        "The task is to add. Attempt: twenty two and more",
        "The task",
    ]
    got = _next_token_logprobs(base, prompts, batch_size=2)
    tokenizer, model = _load(base)
    with torch.inference_mode():
        for row, prompt in zip(got, prompts, strict=True):
            ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
            assert torch.allclose(row, model(ids).logits[0, -1].log_softmax(-1), atol=1e-4)


def test_an_unknown_method_is_refused():
    with pytest.raises(ValueError, match="'digits' or 'pairwise'"):
        art.LocalJudge(method="listwise")  # type: ignore[arg-type]


@pytest.mark.slow
def test_the_measurement_script_scores_recorded_groups_and_prints_the_table(tmp_path, capsys):
    rows = judge_quality.main(
        ["--tasks", "tic_tac_toe", "--judges", "digits", "--groups", "1", "--data", str(tmp_path)]
    )
    assert [(r["judge"], r["task"], r["groups"]) for r in rows] == [("digits", "tic_tac_toe", 1)]
    assert -1 <= rows[0]["spearman"] <= 1 and rows[0]["s_per_group"] > 0
    assert "spearman/target" in capsys.readouterr().out


def test_spearman_handles_ties_and_constant_sides():
    assert judge_quality.spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1)
    assert judge_quality.spearman([3, 2, 1], [10, 20, 30]) == pytest.approx(-1)
    assert judge_quality.spearman([1, 1, 2], [0, 0, 1]) == pytest.approx(1)
    assert judge_quality.spearman([1, 1, 1], [0, 1, 2]) == 0


def test_the_measurement_script_plays_every_task_it_offers():
    assert (
        set(judge_quality.rollouts()) == set(judge_quality.TASKS) == {"tic_tac_toe", "temporal_clue", "art_e"}
    )
    with pytest.raises(SystemExit):  # an unknown task is refused by name, not silently skipped
        judge_quality.main(["--tasks", "chess"])


def test_reports_and_panels_name_a_judge_by_the_call_that_makes_it():
    assert art.LocalJudge().label == "art.LocalJudge(method='digits')"
    judge = art.LocalJudge(base_model="/models/judge", method="pairwise")
    assert judge.label == "art.LocalJudge(base_model='/models/judge', method='pairwise')"
