"""2048: the rules (merges, invalid moves, spawns, game over), the reward, and a rollout on a real engine."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from openai.types.chat.chat_completion import Choice

from artnb.core.tokenize import tokenize_trajectory
from artnb.tasks import game_2048
from artnb.tasks.game_2048 import DIRECTIONS, Board, Game, parse_move, slide_row


@pytest.mark.parametrize(
    "row, slid, score, merges",
    [
        ([2, 2, 2, 2], [4, 4, 0, 0], 8, 2),
        ([2, 2, 4, 0], [4, 4, 0, 0], 4, 1),  # the new 4 does not merge again into 8
        ([2, 2, 2, 0], [4, 2, 0, 0], 4, 1),  # the pair nearest the wall merges
        ([0, 0, 0, 2], [2, 0, 0, 0], 0, 0),
        ([4, 0, 4, 4], [8, 4, 0, 0], 8, 1),
        ([8, 8, 16, 16], [16, 32, 0, 0], 48, 2),
        ([2, 4, 8, 16], [2, 4, 8, 16], 0, 0),
    ],
)
def test_slide_row(row, slid, score, merges):
    assert slide_row(row) == (slid, score, merges)


def test_moves_merge_toward_the_move_direction():
    board = Board.of([[2, 2, 2, 0], [0, 0, 0, 0], [0, 0, 0, 0], [2, 0, 0, 0]])
    assert board.move("left").board.rows[0] == (4, 2, 0, 0)
    assert board.move("right").board.rows[0] == (0, 0, 2, 4)
    up = board.move("up").board
    assert [r[0] for r in up.rows] == [4, 0, 0, 0] and up.rows[0] == (4, 2, 2, 0)
    down = board.move("down").board
    assert [r[0] for r in down.rows] == [0, 0, 0, 4] and down.rows[3] == (4, 2, 2, 0)
    column = Board.of([[2, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0], [0, 0, 0, 0]])
    assert [r[0] for r in column.move("down").board.rows] == [0, 0, 4, 4]
    assert column.move("down").score == 4 and column.move("down").merges == 1


def test_invalid_move_changes_nothing_and_spawns_nothing():
    board = Board.of([[2, 4, 8, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    assert not board.move("left").changed and not board.move("up").changed
    assert board.move("right").changed and board.move("down").changed
    assert board.valid_moves() == ["right", "down"]
    game = Game(random.Random(0), board)
    assert game.play("left") is False
    assert game.board == board and game.invalid_moves == 1 and game.malformed == 0
    assert game.play(None) is False and game.malformed == 1 and game.board == board
    assert game.play("down") is True
    assert len(game.board.empty_cells()) == 12  # 3 tiles slid down, one new tile
    assert game.moves == 3 and game.history == ["left", "?", "down"]


def test_unknown_direction_is_an_error_not_a_silent_no_op():
    with pytest.raises(ValueError, match="direction must be one of"):
        Board.empty().move("north")


def test_spawns_are_seeded_and_2_with_probability_0_9():
    assert Board.start(random.Random(5)) == Board.start(random.Random(5))
    values, cells = Counter(), Counter()
    for seed in range(4000):
        board = Board.empty().spawn(random.Random(seed))
        ((r, c),) = [(r, c) for r in range(4) for c in range(4) if board.rows[r][c]]
        values[board.rows[r][c]] += 1
        cells[(r, c)] += 1
    assert set(values) == {2, 4}
    assert 0.88 < values[2] / 4000 < 0.92
    assert len(cells) == 16 and min(cells.values()) > 4000 / 16 * 0.7  # every empty cell, roughly uniform
    almost_full = Board.of([[2, 4, 2, 4], [4, 2, 4, 2], [2, 4, 2, 4], [4, 2, 4, 0]])
    assert almost_full.spawn(random.Random(0)).rows[3][3] in (2, 4)
    with pytest.raises(ValueError, match="no empty cell"):
        almost_full.spawn(random.Random(0)).spawn(random.Random(0))


def test_game_over_only_when_no_move_changes_the_board():
    stuck = Board.of([[2, 4, 2, 4], [4, 2, 4, 2], [2, 4, 2, 4], [4, 2, 4, 2]])
    assert stuck.game_over() and stuck.valid_moves() == []
    vertical_pair = Board.of([[2, 4, 2, 4], [4, 2, 4, 2], [2, 4, 2, 4], [2, 8, 16, 32]])
    assert not vertical_pair.game_over() and set(vertical_pair.valid_moves()) == {"up", "down"}
    game = Game(random.Random(0), stuck)
    assert game.done
    with pytest.raises(RuntimeError, match="game is over"):
        game.play("left")


def test_win_ends_the_game_and_reward_is_shaped():
    board = Board.of([[32, 32, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    game = Game(random.Random(0), board, win_tile=64)
    assert game.progress == pytest.approx(5 / 6) and not game.won
    assert game.play("left") and game.won and game.done
    # progress 1 + 0.5 * score 64 / (5 * 64) + win 1
    assert game.reward == pytest.approx(1 + 0.5 * 64 / 320 + 1)
    loser = Game(random.Random(0), board, win_tile=128)
    loser.play("up")
    assert loser.reward == pytest.approx(5 / 7 - 0.1)  # one invalid move, no merge


def test_invalid_moves_are_penalised_and_capped():
    game = Game.new(3, max_invalid_moves=3)
    start = game.reward
    for _ in range(3):
        assert not game.done
        game.play(None)
    assert game.done and game.moves == 3
    assert game.reward == pytest.approx(start - 0.3)


def test_bad_settings_say_what_works():
    with pytest.raises(ValueError, match="power of two"):
        Game.new(0, win_tile=100)
    with pytest.raises(ValueError, match=">= 1"):
        Game.new(0, max_moves=0)


def test_parse_move_is_lenient_about_case_and_punctuation_only():
    assert parse_move("Left.") == "left" and parse_move(" up\n") == "up" and parse_move("**down**") == "down"
    assert parse_move("north") is None and parse_move("go left") is None and parse_move(None) is None


def test_a_random_player_wins_about_a_third_of_default_games():
    """The docstring's claim, which makes 64 a sensible default win tile: groups mix wins and losses."""
    wins, moves = 0, []
    for seed in range(200):
        game, player = Game.new(seed), random.Random(seed + 10_000)
        while not game.done:
            game.play(player.choice(DIRECTIONS))
        wins += game.won
        moves.append(game.moves)
    assert 0.2 < wins / 200 < 0.45
    assert 35 < sum(moves) / len(moves) < 60


async def test_rollout_on_a_real_engine(tiny_model, tiny_tokenizer):
    traj = await game_2048.rollout(tiny_model, scenario=1, win_tile=16, max_moves=12)
    turns = traj.histories()
    assert len(turns) == traj.metrics["moves"] == traj.trainable_turns()
    for turn in turns:
        system, user, choice = turn.messages_and_choices
        assert system["role"] == "system" and "2048" in system["content"] and user["role"] == "user"
        assert isinstance(choice, Choice) and choice.logprobs.content
        assert choice.message.content in DIRECTIONS  # constrained
    assert traj.metrics["malformed_replies"] == 0
    assert math.isfinite(traj.reward)
    for key in ("win", "max_tile", "score", "moves", "invalid_moves", "valid_move_rate", "duration"):
        assert key in traj.metrics
    expected = traj.metrics["progress"] + float(traj.metrics["win"]) - 0.1 * traj.metrics["invalid_moves"]
    assert traj.reward >= expected  # the merge score is never negative
    assert traj.logs and traj.metadata == {"scenario": 1, "win_tile": 16}
    sequences = tokenize_trajectory(tiny_tokenizer, traj, advantage=1.0)
    assert len(sequences) == len(turns) and all(s.num_trainable_tokens() >= 1 for s in sequences)


async def test_unconstrained_rollout_penalises_malformed_replies(tiny_model):
    """The tiny random model does not say a direction unprompted: every reply is invalid, none crashes."""
    traj = await game_2048.rollout(tiny_model, scenario=2, constrained=False, max_invalid_moves=3)
    assert traj.metrics["malformed_replies"] == traj.metrics["invalid_moves"] == traj.metrics["moves"] == 3
    assert traj.reward == pytest.approx(traj.metrics["progress"] - 0.3)
    assert "was not a move" in traj.histories()[-1].messages_and_choices[1]["content"]
