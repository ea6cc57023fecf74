"""Temporal Clue: every puzzle has exactly one answer (checked two ways), scoring, and a real rollout."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from openai.types.chat.chat_completion import Choice

from artnb.core.tokenize import tokenize_trajectory
from artnb.tasks import temporal_clue
from artnb.tasks.temporal_clue import (
    Answer,
    Clue,
    Ref,
    World,
    _decode,
    _worlds,
    consistent_answers,
    generate_puzzle,
    holds,
)


def brute_force(puzzle) -> set[Answer]:
    """An oracle independent of the generator's numpy masks: every world, every clue, through `holds`."""
    n = len(puzzle.suspects)
    perms = list(itertools.permutations(range(n)))
    answers = set()
    for room, obj, hour in itertools.product(perms, repeat=3):
        for culprit in range(n):
            world = World(room, obj, hour, culprit)
            if all(holds(c, world) for c in puzzle.clues):
                answers.add(puzzle.answer_in(world))
    return answers


@pytest.mark.parametrize("difficulty, seeds", [(1, range(200)), (2, range(60)), (3, range(60))])
def test_every_puzzle_has_exactly_one_answer(difficulty, seeds):
    for seed in seeds:
        puzzle = generate_puzzle(seed, difficulty)
        assert consistent_answers(puzzle) == {puzzle.solution}, (difficulty, seed)
        assert all(holds(c, puzzle.world) for c in puzzle.clues)


def test_uniqueness_holds_for_the_plain_python_oracle_too():
    for seed in range(40):
        puzzle = generate_puzzle(seed, 1)
        assert brute_force(puzzle) == {puzzle.solution}, seed
    for seed in range(2):
        puzzle = generate_puzzle(seed, 3)
        assert brute_force(puzzle) == {puzzle.solution}, seed


def test_vectorised_masks_agree_with_holds_on_every_world():
    worlds = _worlds(3)
    every = _decode(worlds, np.arange(len(worlds.answer)))
    clues = [c for seed in range(10) for c in generate_puzzle(seed, 1).clues]
    clues += [
        Clue("earlier", Ref("hour", 0), Ref("culprit")),
        Clue("gap", Ref("room", 2), Ref("object", 1), 2),
    ]
    for clue in clues:
        assert worlds.mask(clue).tolist() == [holds(clue, w) for w in every], clue


def test_no_clue_is_redundant_and_the_culprit_is_never_named():
    for seed in range(20):
        puzzle = generate_puzzle(seed, 2)
        for i in range(len(puzzle.clues)):
            fewer = puzzle.clues[:i] + puzzle.clues[i + 1 :]
            looser = temporal_clue.Puzzle(
                seed, 2, puzzle.suspects, puzzle.rooms, puzzle.objects, puzzle.hours, fewer, puzzle.world
            )
            assert len(consistent_answers(looser)) > 1, (seed, i)
        assert not any(c.kind == "same" and c.a.kind == "culprit" for c in puzzle.clues)


def test_difficulty_sets_size_and_how_direct_the_clues_are():
    def direct(d):
        return sum(
            c.kind == "same" and c.a.kind == "person" for s in range(40) for c in generate_puzzle(s, d).clues
        )

    assert len(generate_puzzle(0, 1).suspects) == 3 and len(generate_puzzle(0, 2).suspects) == 4
    assert direct(3) < direct(2) / 2
    assert generate_puzzle(5, 2).prompt() == generate_puzzle(5, 2).prompt()
    assert generate_puzzle(5, 2).prompt() != generate_puzzle(6, 2).prompt()
    with pytest.raises(ValueError, match="difficulty must be one of"):
        generate_puzzle(0, 4)


def test_clues_read_as_english():
    puzzle = generate_puzzle(0, 1)
    s, r, o, h = puzzle.suspects, puzzle.rooms, puzzle.objects, puzzle.hours
    assert puzzle.describe(Clue("same", Ref("person", 0), Ref("object", 1))) == f"{s[0]} had the {o[1]}."
    assert (
        puzzle.describe(Clue("different", Ref("culprit"), Ref("room", 2)))
        == f"The culprit was not in the {r[2]}."
    )
    assert (
        puzzle.describe(Clue("earlier", Ref("room", 0), Ref("hour", 2)))
        == f"The person in the {r[0]} arrived before {h[2]}."
    )
    assert (
        puzzle.describe(Clue("earlier", Ref("hour", 0), Ref("object", 2)))
        == f"The person with the {o[2]} arrived after {h[0]}."
    )
    assert (
        puzzle.describe(Clue("gap", Ref("person", 1), Ref("culprit"), 1))
        == f"{s[1]} arrived 1 hour after the culprit."
    )
    assert puzzle.describe(puzzle.clues[0]) in puzzle.prompt()


def test_partial_credit_per_field_and_a_penalty_for_malformed_replies():
    puzzle = generate_puzzle(1, 2)
    truth = puzzle.solution
    assert puzzle.score(truth.as_json()).reward == 1.0
    wrong_who = next(x for x in puzzle.suspects if x != truth.who)
    wrong_when = next(x for x in puzzle.hours if x != truth.when)
    half = json.dumps({"who": wrong_who, "what": truth.what, "where": truth.where, "when": wrong_when})
    score = puzzle.score(half)
    assert (
        score.reward == 0.5
        and score.format_ok
        and score.correct
        == {
            "who": False,
            "what": True,
            "where": True,
            "when": False,
        }
    )
    fields = {
        "who": truth.who.upper(),
        "what": truth.what,
        "where": truth.where,
        "when": f"{truth.when[:-2]} PM",
    }
    loose = f"```json\n{json.dumps(fields)}\n```"
    assert puzzle.score(loose).reward == 1.0  # case, spaces and a code fence do not matter
    missing = json.dumps({"who": truth.who, "what": truth.what})
    assert puzzle.score(missing).reward == pytest.approx(0.5 - 0.25) and not puzzle.score(missing).format_ok
    unknown = json.dumps({"who": "Sherlock", "what": truth.what, "where": truth.where, "when": truth.when})
    assert puzzle.score(unknown).reward == pytest.approx(0.75 - 0.25)
    for bad in (None, "", "Ada in the library", "[1, 2]", "{not json}", '{"who": 3}'):
        assert puzzle.score(bad).reward == -0.25 and not puzzle.score(bad).format_ok


def test_answer_choices_are_every_well_formed_answer():
    puzzle = generate_puzzle(2, 2)
    choices = puzzle.answer_choices()
    assert len(choices) == len(set(choices)) == 4**4
    rewards = [puzzle.score(c).reward for c in choices]
    assert all(puzzle.score(c).format_ok for c in choices)
    assert rewards.count(1.0) == 1 and rewards.count(0.0) == 3**4


async def test_rollout_on_a_real_engine(tiny_model, tiny_tokenizer):
    traj = await temporal_clue.rollout(tiny_model, scenario=4, difficulty=2)
    system, user, choice = traj.messages_and_choices
    assert isinstance(choice, Choice) and choice.logprobs.content
    puzzle = generate_puzzle(4, 2)
    assert user["content"] == puzzle.prompt()
    assert choice.message.content in puzzle.answer_choices()  # constrained
    assert traj.metrics["format_ok"] is True
    assert traj.reward == traj.metrics["correct_fields"] / 4 and math.isfinite(traj.reward)
    for key in (
        "who_correct",
        "what_correct",
        "where_correct",
        "when_correct",
        "solved",
        "clues",
        "duration",
    ):
        assert key in traj.metrics
    assert traj.metadata["solution"] == puzzle.solution.as_json()
    (sequence,) = tokenize_trajectory(tiny_tokenizer, traj, advantage=1.0)
    assert sequence.num_trainable_tokens() >= 10


async def test_unconstrained_rollout_penalises_a_malformed_reply(tiny_model):
    traj = await temporal_clue.rollout(tiny_model, scenario=4, difficulty=1, constrained=False)
    assert traj.metrics["format_ok"] is False
    assert traj.reward == traj.metrics["correct_fields"] / 4 - 0.25 < 0.5
