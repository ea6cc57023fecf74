"""Tic-tac-toe against a random opponent: the smallest multi-turn agent task that a 135M model can learn.

The model plays either side; each of its moves is one chat request in one growing conversation (a game has at
most five), whose answer is constrained to the nine cell names (`structured_outputs.choice`, which both artnb
engines and vLLM honour; vLLM ignores the older `guided_choice` without a word). A 135M model does not follow
free-form formats, and a constrained answer makes every reply well-formed, so what is learned is which cell:
first to pick empty cells (legal moves), then to win. With `constrained=False` (e.g. a hosted model) the reply
is read leniently ("b2." is B2) and anything else is an illegal move. Reward: win 1, draw 0.5, loss 0, an
illegal move ends the game at -0.5; each legal move adds 0.1, so legality is rewarded before the model can win
often.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from ..core.model import Model
from ..core.trajectory import Trajectory
from .replies import ask_choice, parse_word

CELLS = [f"{r}{c}" for r in "ABC" for c in "123"]
LINES = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]
SYSTEM = (
    "You play tic-tac-toe as {side}. Cells are named by row A-C and column 1-3, e.g. B2 is the centre. "
    "Reply with the name of one empty cell ('.') to place your {side}."
)


@dataclass
class Board:
    cells: list[str] = field(default_factory=lambda: ["."] * 9)

    def render(self) -> str:
        rows = [f"{r} {' '.join(self.cells[i * 3 : i * 3 + 3])}" for i, r in enumerate("ABC")]
        return "  1 2 3\n" + "\n".join(rows)

    def empty(self) -> list[int]:
        return [i for i, c in enumerate(self.cells) if c == "."]

    def winner(self) -> str | None:
        for a, b, c in LINES:
            if self.cells[a] != "." and self.cells[a] == self.cells[b] == self.cells[c]:
                return self.cells[a]
        return None

    def full(self) -> bool:
        return not self.empty()


@dataclass
class Outcome:
    result: str  # "win", "draw", "loss" or "illegal"
    legal_moves: int
    moves: int

    @property
    def reward(self) -> float:
        base = {"win": 1.0, "draw": 0.5, "loss": 0.0, "illegal": -0.5}[self.result]
        return base + 0.1 * self.legal_moves


def parse_cell(text: str | None) -> str | None:
    """The cell a reply names ("b2." -> "B2"), or None when it names none."""
    return parse_word(text, CELLS)


async def rollout(
    model: Model,
    scenario: int,
    *,
    side: str = "X",
    step: int | None = None,
    temperature: float = 1.0,
    constrained: bool = True,
) -> Trajectory:
    """Play one game; `scenario` seeds the opponent. X moves first. Returns the scored trajectory."""
    if side not in ("X", "O"):
        raise ValueError(f"side must be 'X' or 'O', got {side!r}")
    opponent = "O" if side == "X" else "X"
    rng = random.Random(scenario)
    board = Board()
    traj = Trajectory(
        messages_and_choices=[{"role": "system", "content": SYSTEM.format(side=side)}],
        metadata={"scenario": scenario, "side": side},
    )
    legal = moves = 0
    turn = "X"
    result = None
    while result is None:
        if turn == opponent:
            board.cells[rng.choice(board.empty())] = opponent
        else:
            traj.messages_and_choices.append({"role": "user", "content": board.render()})
            choice = await ask_choice(
                model,
                traj.messages(),
                CELLS,
                step=step,
                temperature=temperature,
                constrained=constrained,
                max_tokens=4,
                free_max_tokens=16,
            )
            traj.messages_and_choices.append(choice)
            moves += 1
            answer = parse_cell(choice.message.content)
            if answer is None or board.cells[CELLS.index(answer)] != ".":
                result = "illegal"
                traj.log(f"illegal move {choice.message.content!r} on\n{board.render()}")
                break
            legal += 1
            board.cells[CELLS.index(answer)] = side
        win = board.winner()
        if win is not None:
            result = "win" if win == side else "loss"
        elif board.full():
            result = "draw"
        turn = "O" if turn == "X" else "X"
    outcome = Outcome(result, legal, moves)
    traj.reward = outcome.reward
    traj.metrics.update(
        {
            "win": result == "win",
            "draw": result == "draw",
            "loss": result == "loss",
            "illegal": result == "illegal",
            "legal_move_rate": legal / moves if moves else 0.0,
            "moves": moves,
        }
    )
    traj.log(f"{result} after {moves} moves\n{board.render()}")
    return traj.finish()
