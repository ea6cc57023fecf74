"""Codenames: the word list, the deal, clue validity, rules and scoring, grouping by role, real games."""

from __future__ import annotations

import json
import math
import re

import pytest
from openai.types.chat.chat_completion import Choice

import artnb as art
from artnb.core.tokenize import tokenize_trajectory
from artnb.core.trajectory import Trajectory
from artnb.tasks import codenames
from artnb.tasks.codenames import (
    Board,
    Game,
    clue_problem,
    clue_vocabulary,
    groups_by_role,
    parse_clue,
    parse_guesses,
)
from artnb.tasks.codenames_words import BOARD_WORDS, CLUE_WORDS

# A hand-made board: red r0..r8, blue b0..b7, neutral n0..n6, the assassin x.
WORDS = [f"r{i}" for i in range(9)] + [f"b{i}" for i in range(8)] + [f"n{i}" for i in range(7)] + ["x"]
COLORS = ["red"] * 9 + ["blue"] * 8 + ["neutral"] * 7 + ["assassin"]


def game(**kwargs) -> Game:
    return Game(Board(tuple(WORDS), tuple(COLORS)), **kwargs)


def test_word_list_is_ours_and_clean():
    assert len(BOARD_WORDS) >= 200 and len(set(BOARD_WORDS)) == len(BOARD_WORDS)
    assert all(re.fullmatch(r"[a-z]+", w) for w in BOARD_WORDS + CLUE_WORDS)
    assert not [(a, b) for a in BOARD_WORDS for b in BOARD_WORDS if a != b and a in b]
    assert not set(CLUE_WORDS) & set(BOARD_WORDS)


def test_deal_is_seeded_with_9_8_7_1_colours():
    board = Board.deal(11)
    assert board == Board.deal(11) and board != Board.deal(12)
    assert len(board.words) == len(set(board.words)) == 25
    assert {c: board.colors.count(c) for c in set(board.colors)} == {
        "red": 9,
        "blue": 8,
        "neutral": 7,
        "assassin": 1,
    }
    assert set(board.words) <= set(BOARD_WORDS)
    assert board.words_of("assassin") == [w for w in board.words if board.color(w) == "assassin"]


@pytest.mark.parametrize(
    "word, count, reason",
    [
        ("metal", 2, None),
        ("apple", 1, "is a word on the board"),
        ("sea", 2, "is part of the board word 'seal'"),
        ("apples", 2, "contains the board word 'apple'"),
        ("ice cream", 2, "not one word"),
        ("Metal", 2, "not one word"),
        ("r2d2", 2, "not one word"),
        ("", 1, "not one word"),
        (None, 1, "not one word"),
        ("metal", 0, "from 1 to 9"),
        ("metal", 10, "from 1 to 9"),
        ("metal", True, "from 1 to 9"),
        ("metal", "2", "from 1 to 9"),
    ],
)
def test_clue_validity(word, count, reason):
    problem = clue_problem(word, count, ["apple", "seal", "river"])
    assert problem is None if reason is None else reason in problem


def test_constrained_clue_words_are_all_valid_on_their_board():
    for seed in range(20):
        board = Board.deal(seed)
        vocabulary = clue_vocabulary(board)
        assert len(vocabulary) > 250
        assert all(clue_problem(w, 1, board.words) is None for w in vocabulary)
        assert not set(vocabulary) & set(board.words)


def test_guesses_follow_the_rules():
    g = game()
    made, problem = g.guesses(["r0", "r1", "r1", "n0", "r2"], count=3)  # repeats once; stops at neutral
    assert made == [("r0", "red"), ("r1", "red"), ("n0", "neutral")] and problem is None
    assert g.left("red") == 7 and not g.over
    g.end_turn()
    assert g.team == "blue"
    made, problem = g.guesses(["b0", "b1", "b2", "b3"], count=2)  # at most count + 1
    assert [w for w, _ in made] == ["b0", "b1", "b2"] and problem is None
    g.end_turn()
    made, problem = g.guesses(["r3", "banana", "r4"], count=2)
    assert made == [("r3", "red")] and "'banana' is not an unrevealed word" in problem
    made, problem = g.guesses(["r3"], count=1)
    assert made == [] and "'r3' is not an unrevealed word" in problem
    assert g.guesses([], count=1) == ([], "no word was guessed")


def test_assassin_ends_the_game_and_loses_it():
    g = game()
    made, _ = g.guesses(["r0", "x", "r1"], count=2)
    assert made == [("r0", "red"), ("x", "assassin")]
    assert g.over and g.end == "assassin" and g.winner == "blue"
    assert g.outcome("red") == 0.0 and g.outcome("blue") == 1.0
    with pytest.raises(RuntimeError, match="game is over"):
        g.guess("r1")
    with pytest.raises(RuntimeError, match="game is over"):
        g.end_turn()


def test_a_team_wins_when_its_last_word_is_revealed_even_by_the_opponent():
    g = game()
    for w in WORDS[9:16]:  # seven of blue's eight words, revealed by red
        g.guess(w)
    assert not g.over
    g.guess("b7")
    assert g.over and g.end == "words" and g.winner == "blue"
    g = game()
    g.guesses(WORDS[:9], count=9)
    assert g.winner == "red" and g.end == "words" and g.margin("red") == 1.0


def test_turn_limit_compares_shares_of_words_found():
    g = game(max_turns=2)
    g.end_turn()
    g.end_turn()
    assert g.over and g.end == "turn limit" and g.winner is None  # nothing found: a draw, not a win for blue
    assert g.outcome("red") == g.outcome("blue") == 0.5
    g = game(max_turns=2)
    g.guesses(["r0", "r1", "r2", "n0"], count=3)
    g.end_turn()
    g.guesses(["b0", "b1", "b2", "n1"], count=3)  # 3 of 8 beats 3 of 9
    g.end_turn()
    assert g.winner == "blue"


def test_reward_is_outcome_plus_margin_minus_invalid_moves():
    g = game()
    g.guesses(["r0", "r1", "r2", "b0"], count=3)  # red 3/9, blue 1/8
    g.end_turn()
    g.guesses(["x"], count=1)  # blue hits the assassin
    margin = 3 / 9 - 1 / 8
    assert g.margin("red") == pytest.approx(margin) and g.margin("blue") == pytest.approx(-margin)
    assert g.reward("red", invalid_moves=0) == pytest.approx(1 + 0.5 * margin)
    assert g.reward("red", invalid_moves=2) == pytest.approx(1 + 0.5 * margin - 0.2)
    assert g.reward("blue", invalid_moves=0) == pytest.approx(-0.5 * margin)
    with pytest.raises(RuntimeError, match="not over"):
        game().outcome("red")


def test_replies_are_parsed_leniently_and_malformed_ones_are_none():
    assert parse_clue('{"clue": "Metal", "count": 2}') == ("metal", 2)
    assert parse_clue('Sure! ```json\n{"clue": "sea", "count": "3"}\n```') == ("sea", 3)
    for bad in (
        None,
        "",
        "metal 2",
        '{"clue": "metal"}',
        '{"clue": "metal", "count": true}',
        "[1]",
        "{oops}",
    ):
        assert parse_clue(bad) is None
    assert parse_guesses('{"guesses": ["Apple", " seal"]}') == ["apple", "seal"]
    for bad in (None, "apple", '{"guesses": "apple"}', '{"guesses": [1]}', '{"guess": ["apple"]}'):
        assert parse_guesses(bad) is None


def test_schemas_constrain_to_valid_moves():
    g = game()
    g.guess("r0")
    schema = codenames.guess_schema(g, count=2)["properties"]["guesses"]
    assert schema["maxItems"] == 3 and schema["minItems"] == 1 and "r0" not in schema["items"]["enum"]
    board = Board.deal(0)
    clue = codenames.clue_schema(board)["properties"]
    assert clue["clue"]["enum"] == clue_vocabulary(board) and (
        clue["count"]["minimum"],
        clue["count"]["maximum"],
    ) == (1, 9)


def choice(text: str) -> Choice:
    return Choice.model_validate(
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}
    )


def played(scenario, team, role, turns=1) -> Trajectory:
    traj = Trajectory(metadata={"scenario": scenario, "team": team, "role": role})
    if turns:
        traj.messages_and_choices = [{"role": "user", "content": "board"}, choice("{}")]
    return traj


def test_groups_by_role_compare_like_with_like():
    games = [
        [
            played(1, "red", "spymaster"),
            played(1, "red", "operative"),
            played(1, "blue", "spymaster", turns=0),
        ],
        [played(1, "red", "spymaster"), played(1, "red", "operative"), played(1, "blue", "spymaster")],
        RuntimeError("a failed game"),
        [played(2, "red", "spymaster"), played(1, "red", "spymaster")],
    ]
    groups = groups_by_role(games)
    keys = [(g.metadata["scenario"], g.metadata["team"], g.metadata["role"]) for g in groups]
    # blue spymaster on board 1 played once (the other game ended first) and board 2 once: no group to compare
    assert keys == [(1, "red", "spymaster"), (1, "red", "operative")]
    assert [len(g) for g in groups] == [3, 2]
    for g in groups:
        assert {(t.metadata["scenario"], t.metadata["team"], t.metadata["role"]) for t in g} == {
            keys[groups.index(g)]
        }


async def test_self_play_on_a_real_engine(tiny_model, tiny_tokenizer):
    trajs = await codenames.play(tiny_model, scenario=5, max_turns=4)
    assert [(t.metadata["team"], t.metadata["role"]) for t in trajs] == [
        ("red", "spymaster"),
        ("red", "operative"),
        ("blue", "spymaster"),
        ("blue", "operative"),
    ]
    board = Board.deal(5)
    for t in trajs:
        assert math.isfinite(t.reward)
        assert t.metrics["invalid_moves"] == 0  # constrained: every clue and guess is valid
        assert t.metrics["turns"] == t.trainable_turns()
        if t.trainable_turns():
            assert len(t.histories()) == t.trainable_turns()  # one conversation per turn
        for key in ("win", "draw", "margin", "own_words_found", "game_turns", "hit_assassin", "duration"):
            assert key in t.metrics
        assert t.logs and "after" in t.logs[-1]
    red_spymaster, red_operative = trajs[0], trajs[1]
    assert red_spymaster.metrics["valid_clue_rate"] == 1.0 and red_operative.metrics["guesses"] >= 1
    for turn in red_spymaster.histories():
        system, user, reply = turn.messages_and_choices
        assert "spymaster" in system["content"] and "The assassin:" in user["content"]
        assert isinstance(reply, Choice) and reply.logprobs.content
        clue = json.loads(reply.message.content)
        assert clue_problem(clue["clue"], clue["count"], board.words) is None
    for turn in red_operative.histories():
        system, user, reply = turn.messages_and_choices
        assert "The assassin" not in user["content"]  # operatives do not see colours
        assert set(parse_guesses(reply.message.content)) <= set(board.words)
    for seq in tokenize_trajectory(tiny_tokenizer, red_spymaster, advantage=1.0):
        assert seq.num_trainable_tokens() >= 5


async def test_self_play_groups_and_malformed_moves_on_a_real_engine(tiny_model):
    groups = await codenames.self_play_groups(tiny_model, [6], games_per_scenario=2, max_turns=2)
    roles = [(g.metadata["team"], g.metadata["role"]) for g in groups]
    assert roles[:2] == [("red", "spymaster"), ("red", "operative")] and all(len(g) == 2 for g in groups)
    # unconstrained, the tiny random model writes no JSON: each clue is refused and penalised, nothing crashes
    trajs = await codenames.play(tiny_model, scenario=6, constrained=False, max_turns=3)
    red_spymaster, red_operative, blue_spymaster, _ = trajs
    assert red_spymaster.metrics["invalid_moves"] == red_spymaster.metrics["turns"] == 2
    assert red_spymaster.reward == pytest.approx(0.5 - 0.2)  # a draw (nothing revealed) less two penalties
    assert blue_spymaster.reward == pytest.approx(0.5 - 0.1)
    assert "was refused" in red_spymaster.histories()[1].messages_and_choices[1]["content"]
    assert red_operative.trainable_turns() == 0
    assert [g.metadata["role"] for g in groups_by_role([trajs, trajs])] == ["spymaster", "spymaster"]
    # a refused clue is a valid-clue rate of 0; a spymaster who never had a turn has no rate (not a 0 that
    # would drag the evaluation's mean down as if their clues had been refused)
    red_spymaster, _, blue_spymaster, _ = await codenames.play(
        tiny_model, scenario=6, constrained=False, max_turns=1
    )
    assert red_spymaster.metrics["valid_clue_rate"] == 0.0 and "mean_clue_count" not in red_spymaster.metrics
    assert blue_spymaster.metrics["turns"] == 0 and "valid_clue_rate" not in blue_spymaster.metrics


async def test_head_to_head_plays_each_board_once_as_each_colour(tiny_model):
    twin = art.Model(
        name="twin",
        inference_model_name="base",
        inference_base_url=tiny_model.inference_base_url,
        inference_api_key=tiny_model.inference_api_key,
    )
    table = await codenames.head_to_head({"a": tiny_model, "b": twin}, [3, 4], max_turns=2)
    assert len(table) == 2 * 2 * 4  # boards x colours x roles
    for (board, model), rows in table.groupby(["scenario", "model"]):
        assert sorted(rows["team"]) == ["blue", "blue", "red", "red"], (board, model)
    for (board, team), rows in table.groupby(["scenario", "team"]):
        assert sorted(rows["model"]) == ["a", "a", "b", "b"], (board, team)
    spymasters = table[table.role == "spymaster"]
    for board in (3, 4):
        for red in ("a", "b"):  # one game: red's spymaster and the other model's blue one
            blue = "b" if red == "a" else "a"
            game = spymasters[
                (spymasters.scenario == board)
                & (
                    ((spymasters.model == red) & (spymasters.team == "red"))
                    | ((spymasters.model == blue) & (spymasters.team == "blue"))
                )
            ]
            assert len(game) == 2
            assert game.win.sum() + game.draw.iloc[0] == 1  # one winner, or a draw
    summary = art.summarize_evaluation(table, ["win", "draw"])
    assert list(summary.index) == ["a", "b"]


async def test_the_opponent_plays_blue(tiny_model):
    unserved = art.Model(
        name="nobody",
        inference_base_url=tiny_model.inference_base_url,
        inference_api_key=tiny_model.inference_api_key,
    )
    trajs = await codenames.play(
        tiny_model, 3, max_turns=1, opponent=unserved
    )  # red's turn only: blue never asked
    assert trajs[0].trainable_turns() == 1 and trajs[2].trainable_turns() == 0
    with pytest.raises(Exception, match="nobody"):
        await codenames.play(tiny_model, 3, max_turns=2, opponent=unserved)
    with pytest.raises(ValueError, match="exactly two models"):
        await codenames.head_to_head({"a": tiny_model}, [3])
