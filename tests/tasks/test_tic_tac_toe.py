"""Tic-tac-toe: the rules and reward, and games on a real engine from either side, constrained or not."""

from __future__ import annotations

import math

import pytest
from openai.types.chat.chat_completion import Choice

from artnb.tasks import tic_tac_toe
from artnb.tasks.tic_tac_toe import CELLS, Board, Outcome, parse_cell


def test_winner_and_full_board():
    board = Board(list("XXXOO...."))
    assert board.winner() == "X" and not board.full()
    assert Board(list("XOXXOOOXX")).winner() is None and Board(list("XOXXOOOXX")).full()
    assert Board(list("O.X.OX..O")).winner() == "O"


def test_reward_rewards_legal_moves_before_wins():
    assert Outcome("win", 3, 3).reward == pytest.approx(1.3)
    assert Outcome("illegal", 2, 3).reward == pytest.approx(-0.3)
    assert Outcome("loss", 4, 4).reward > Outcome("illegal", 0, 1).reward


def test_parse_cell():
    assert parse_cell("b2.") == "B2" and parse_cell(" A1\n") == "A1"
    assert parse_cell("D4") is None and parse_cell("the centre") is None and parse_cell(None) is None


@pytest.mark.parametrize("side", ["X", "O"])
async def test_rollout_on_a_real_engine(tiny_model, side):
    traj = await tic_tac_toe.rollout(tiny_model, scenario=3, side=side)
    choices = [x for x in traj.messages_and_choices if isinstance(x, Choice)]
    assert len(choices) == traj.metrics["moves"] >= 1
    assert all(c.message.content in CELLS and c.logprobs.content for c in choices)  # constrained
    assert math.isfinite(traj.reward) and traj.metadata["side"] == side
    assert sum(traj.metrics[k] for k in ("win", "draw", "loss", "illegal")) == 1


async def test_unconstrained_rollout_scores_a_malformed_reply_as_illegal(tiny_model):
    traj = await tic_tac_toe.rollout(tiny_model, scenario=3, constrained=False)
    assert traj.metrics["illegal"] and traj.metrics["moves"] == 1
    assert traj.reward == pytest.approx(-0.5)
