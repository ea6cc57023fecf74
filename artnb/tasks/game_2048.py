"""2048 on a 4x4 board: a long multi-turn game in which every move is one constrained choice.

Design choices, and why:
- The original rules. A move slides every tile toward one side; two equal tiles that meet merge into their
  sum, each tile at most once per move, the pair nearest the wall first (left, `[2, 2, 2, 0]` becomes
  `[4, 2, 0, 0]`). A move that changes nothing is invalid. After each valid move a tile appears on a random
  empty cell: a 2 with probability 0.9, else a 4. The game is over when no move changes the board.
- `scenario` seeds the random tiles (`random.Random(scenario)`), so a scenario is one reproducible start; the
  rollouts of a group diverge only where their moves do.
- The win tile is a knob, 64 by default: 2048 takes about a thousand moves, and a notebook's quick mode on a
  CPU needs games of tens of moves. Under the default limits (at most 5 invalid moves) a random player makes
  64 in about a third of its games, which last about 45 moves (`test_game_2048.py` measures it), so a group
  mixes wins and losses and GRPO has something to compare; win_tile=32 halves the game for a quicker run.
- Each move is its own short conversation (system prompt, the current board), stored as one history of the
  trajectory (the first in `messages_and_choices`, the rest in `additional_histories`, all trained with the
  game's advantage). The board is the whole state, so nothing is lost, and a prompt stays about 120 tokens
  however long the game is; one growing conversation would reach 3,000 tokens by move 60, and re-reading it
  every move costs time quadratic in the game's length. Training still costs one short sequence per move.
- Moves are constrained to the four directions (`structured_outputs.choice`, honoured by both artnb engines
  and vLLM). With `constrained=False` (e.g. a hosted model) the reply is read leniently ("Left." is left) and
  anything else counts as an invalid move: a penalty, never a crash.
- Reward = progress + 0.5 x merge score + 1 for a win - 0.1 per invalid move. Progress is log2(largest tile) /
  log2(win tile): for win 64, 1/6 while the largest tile is a 2, and 1 at a win. The merge score is the game's
  score (the sum of merged tiles, as in the original) over the score of building the win tile from 2s, capped
  at 1. Progress alone moves in steps of whole tiles; the merge score rewards every merge on the way.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from ..core.model import Model
from ..core.trajectory import History, Trajectory
from .replies import ask_choice, parse_word

SIZE = 4
DIRECTIONS = ["left", "right", "up", "down"]
DEFAULT_WIN_TILE = 64
DEFAULT_MAX_MOVES = 200
DEFAULT_MAX_INVALID_MOVES = 5
INVALID_PENALTY = 0.1
SYSTEM = (
    "You play 2048 on a 4x4 board. A move slides all tiles left, right, up or down; two equal tiles that "
    "meet merge into one with their sum. After each move a new 2 or 4 appears. Make a {win} tile to win. A "
    "move that changes nothing is wasted. Reply with one word: left, right, up or down."
)


def slide_row(row: list[int]) -> tuple[list[int], int, int]:
    """Slide one row toward index 0. Returns (new row, score gained, number of merges).

    >>> slide_row([2, 2, 4, 0])
    ([4, 4, 0, 0], 4, 1)
    """
    tiles = [t for t in row if t]
    out: list[int] = []
    score = merges = 0
    i = 0
    while i < len(tiles):
        if i + 1 < len(tiles) and tiles[i] == tiles[i + 1]:
            out.append(tiles[i] * 2)
            score += tiles[i] * 2
            merges += 1
            i += 2
        else:
            out.append(tiles[i])
            i += 1
    return out + [0] * (len(row) - len(out)), score, merges


@dataclass(frozen=True)
class Move:
    board: Board  # the board after sliding, before a new tile appears
    score: int  # sum of the tiles made by merges
    merges: int
    changed: bool  # False: an invalid move


@dataclass(frozen=True)
class Board:
    rows: tuple[tuple[int, ...], ...]  # SIZE x SIZE tile values, 0 for an empty cell

    @classmethod
    def empty(cls) -> Board:
        return cls(tuple((0,) * SIZE for _ in range(SIZE)))

    @classmethod
    def of(cls, rows: list[list[int]]) -> Board:
        if len(rows) != SIZE or any(len(r) != SIZE for r in rows):
            raise ValueError(f"a board is {SIZE} rows of {SIZE} tiles, got {[len(r) for r in rows]}")
        return cls(tuple(tuple(r) for r in rows))

    @classmethod
    def start(cls, rng: random.Random) -> Board:
        """An empty board with two random tiles, as the original game starts."""
        return cls.empty().spawn(rng).spawn(rng)

    def move(self, direction: str) -> Move:
        """Slide toward `direction` (one of DIRECTIONS); no new tile is added."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        grid = [list(r) for r in self.rows]
        if direction in ("up", "down"):
            grid = [list(c) for c in zip(*grid, strict=True)]  # columns as rows, index 0 at the top
        reverse = direction in ("right", "down")
        out, score, merges = [], 0, 0
        for row in grid:
            slid, s, m = slide_row(row[::-1] if reverse else row)
            out.append(slid[::-1] if reverse else slid)
            score, merges = score + s, merges + m
        if direction in ("up", "down"):
            out = [list(c) for c in zip(*out, strict=True)]
        board = Board.of(out)
        return Move(board, score, merges, board != self)

    def spawn(self, rng: random.Random) -> Board:
        """A copy with a new tile on a random empty cell: 2 with probability 0.9, else 4."""
        cells = self.empty_cells()
        if not cells:
            raise ValueError("no empty cell to spawn a tile on: check game_over() before spawning")
        r, c = rng.choice(cells)
        value = 2 if rng.random() < 0.9 else 4
        grid = [list(row) for row in self.rows]
        grid[r][c] = value
        return Board.of(grid)

    def empty_cells(self) -> list[tuple[int, int]]:
        return [(r, c) for r in range(SIZE) for c in range(SIZE) if self.rows[r][c] == 0]

    def valid_moves(self) -> list[str]:
        return [d for d in DIRECTIONS if self.move(d).changed]

    def game_over(self) -> bool:
        return not self.valid_moves()

    def max_tile(self) -> int:
        return max(max(r) for r in self.rows)

    def render(self) -> str:
        width = max(len(str(self.max_tile())), 1)
        return "\n".join(
            " ".join(str(t).rjust(width) if t else ".".rjust(width) for t in r) for r in self.rows
        )


@dataclass
class Game:
    """One game: the board, its random tiles and the running score. `play(direction)` is one reply."""

    rng: random.Random
    board: Board
    win_tile: int = DEFAULT_WIN_TILE
    max_moves: int = DEFAULT_MAX_MOVES  # replies, valid or not
    # so that a model stuck on a wasted move does not play out max_moves
    max_invalid_moves: int = DEFAULT_MAX_INVALID_MOVES
    score: int = 0  # the original game's score: the sum of all merged tiles
    merges: int = 0
    moves: int = 0
    invalid_moves: int = 0  # replies that changed nothing or named no direction
    malformed: int = 0  # of those, replies that named no direction
    history: list[str] = field(default_factory=list)  # directions played, "?" for a malformed reply

    @classmethod
    def new(
        cls,
        scenario: int,
        *,
        win_tile: int = DEFAULT_WIN_TILE,
        max_moves: int = DEFAULT_MAX_MOVES,
        max_invalid_moves: int = DEFAULT_MAX_INVALID_MOVES,
    ) -> Game:
        """A game whose tiles are drawn from `random.Random(scenario)`."""
        if win_tile < 8 or win_tile & (win_tile - 1):
            raise ValueError(f"win_tile must be a power of two >= 8 (e.g. 32, 64, 2048), got {win_tile}")
        if max_moves < 1 or max_invalid_moves < 1:
            raise ValueError(
                f"max_moves and max_invalid_moves must be >= 1, got {max_moves}, {max_invalid_moves}"
            )
        rng = random.Random(scenario)
        return cls(rng, Board.start(rng), win_tile, max_moves, max_invalid_moves)

    def play(self, direction: str | None) -> bool:
        """Apply one reply (None: it named no direction). Returns False for an invalid move."""
        if self.done:
            raise RuntimeError("the game is over: check `done` before playing")
        self.moves += 1
        self.history.append(direction or "?")
        move = self.board.move(direction) if direction is not None else None
        if move is None or not move.changed:
            self.invalid_moves += 1
            self.malformed += int(move is None)
            return False
        self.board = move.board.spawn(self.rng)
        self.score += move.score
        self.merges += move.merges
        return True

    @property
    def won(self) -> bool:
        return self.board.max_tile() >= self.win_tile

    @property
    def done(self) -> bool:
        return (
            self.won
            or self.moves >= self.max_moves
            or self.invalid_moves >= self.max_invalid_moves
            or self.board.game_over()
        )

    @property
    def progress(self) -> float:
        return min(math.log2(self.board.max_tile()) / math.log2(self.win_tile), 1.0)

    @property
    def merge_score(self) -> float:
        """Score over the score of building the win tile from 2s ((log2(win) - 1) x win), capped at 1."""
        return min(self.score / ((math.log2(self.win_tile) - 1) * self.win_tile), 1.0)

    @property
    def reward(self) -> float:
        return self.progress + 0.5 * self.merge_score + float(self.won) - INVALID_PENALTY * self.invalid_moves

    def metrics(self) -> dict[str, float | int | bool]:
        return {
            "win": self.won,
            "game_over": self.board.game_over(),
            "max_tile": self.board.max_tile(),
            "progress": self.progress,
            "score": self.score,
            "merges": self.merges,
            "moves": self.moves,
            "invalid_moves": self.invalid_moves,
            "malformed_replies": self.malformed,
            "valid_move_rate": 1 - self.invalid_moves / self.moves if self.moves else 0.0,
        }


def parse_move(text: str | None) -> str | None:
    """The direction a reply names ("Left." -> "left"), or None when it names none."""
    return parse_word(text, DIRECTIONS)


async def rollout(
    model: Model,
    scenario: int,
    *,
    step: int | None = None,
    temperature: float = 1.0,
    constrained: bool = True,
    win_tile: int = DEFAULT_WIN_TILE,
    max_moves: int = DEFAULT_MAX_MOVES,
    max_invalid_moves: int = DEFAULT_MAX_INVALID_MOVES,
) -> Trajectory:
    """Play one game of 2048; `scenario` seeds the new tiles. Returns the scored trajectory.

    The game ends at a win (a `win_tile` tile), when no move is left, after `max_moves` replies or after
    `max_invalid_moves` invalid ones.

    Example:
        traj = await game_2048.rollout(model, scenario=7, win_tile=32, max_moves=60)
    """
    game = Game.new(scenario, win_tile=win_tile, max_moves=max_moves, max_invalid_moves=max_invalid_moves)
    traj = Trajectory(metadata={"scenario": scenario, "win_tile": win_tile})
    system = {"role": "system", "content": SYSTEM.format(win=win_tile)}
    note = ""
    while not game.done:
        messages = [system, {"role": "user", "content": note + game.board.render()}]
        choice = await ask_choice(
            model,
            messages,
            DIRECTIONS,
            step=step,
            temperature=temperature,
            constrained=constrained,
            max_tokens=4,
            free_max_tokens=16,
        )
        if game.moves == 0:
            traj.messages_and_choices = [*messages, choice]
        else:
            traj.additional_histories.append(History(messages_and_choices=[*messages, choice]))
        reply = choice.message.content or ""
        valid = game.play(parse_move(reply))
        note = "" if valid else f"Your last reply ({reply[:40]!r}) was not a move that changes the board. "
    traj.reward = game.reward
    traj.metrics.update(game.metrics())
    result = "won" if game.won else "no moves left" if game.board.game_over() else "stopped"
    traj.log(f"{result} after {game.moves} moves ({' '.join(game.history)}), score {game.score}")
    traj.log(game.board.render())
    return traj.finish()
