"""Codenames by self-play: one model plays all four roles, and every game trains all four.

The rules are the board game's, with a turn limit. 25 words are dealt from our own list
(`codenames_words.py`): red, who starts, owns 9, blue 8, 7 are neutral and 1 is the assassin. On a team's turn
its spymaster, who sees the colours, gives a one-word clue and a count; its operative, who does not, guesses
up to count + 1 words, stopping at the first that is not the team's. A team wins when all its words are
revealed (by either side); revealing the assassin loses at once. After `max_turns` team turns the team with
the larger share of its words revealed wins (equal shares: a draw; shares, not words left, since blue owns one
word less), so a game between two weak players still ends.

Design choices, and why:
- One game yields four trajectories (red and blue, spymaster and operative). `groups_by_role` makes one group
  per board, team and role, so GRPO compares like with like: red spymasters on one board with each other,
  never with blue ones, who move second and own a word less.
- Each turn is its own short conversation (the role's instructions, the board as that role sees it now, the
  clues so far), stored as one history of the role's trajectory and trained with its advantage, as in
  `game_2048`: prompts stay small however long the game runs.
- Moves have structure, so a JSON schema constrains them (`response_format`, which vLLM and the HF engine both
  enforce with xgrammar): a clue `{"clue": word, "count": 1-9}` whose word is one of the clue words valid on
  this board (`clue_vocabulary`), and `{"guesses": [...]}` of 1 to count + 1 unrevealed board words. A 135M
  model cannot spell a fresh clue word reliably; choosing among ~300 valid ones, it can learn which fit. With
  `constrained=False` (e.g. a hosted model) any reply is read, and the rules check it: a clue must be one word
  of letters, not on the board, not part of a board word nor containing one, with a count from 1 to 9.
- An invalid or malformed clue ends the team's turn; a malformed reply or a word that is not an unrevealed
  board word ends the guessing. Either costs that role a penalty, never a crash.
- Reward = outcome (win 1, draw 0.5, loss 0) + 0.5 x margin - 0.1 per invalid move of the role, where margin
  is the share of the team's words revealed minus the share of the opponent's (-1 to 1), so a close loss beats
  a rout. Both roles of a team share outcome and margin; the penalty is each role's own.
- Evaluation is not self-play: with one model on both sides one of its teams wins every game, so a win rate
  says nothing. `head_to_head` puts the trained model against another (its base) on each board twice, once as
  each colour, since red starts and owns a word more.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import pandas as pd
from openai.types.chat.chat_completion import Choice

from ..core.evaluate import numeric_metrics
from ..core.gather import gather_trajectories, retry
from ..core.model import Model
from ..core.trajectory import History, Trajectory, TrajectoryGroup
from .codenames_words import BOARD_WORDS, CLUE_WORDS
from .replies import TRANSIENT_ERRORS, json_object

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletion, ChatCompletionMessageParam

TEAMS = ("red", "blue")
ROLES = ("spymaster", "operative")
WORDS_PER_COLOR = {"red": 9, "blue": 8, "neutral": 7, "assassin": 1}
DEFAULT_MAX_TURNS = 20  # team turns, 10 each
INVALID_PENALTY = 0.1
_ONE_WORD = re.compile(r"[a-z]+")

SPYMASTER = (
    "You are the {team} spymaster in Codenames. You see which board words are whose; your operative sees "
    "only the words. Give a one-word clue that links as many of your team's unrevealed words as you can, "
    "and the number of words it links. Keep away from the other team's words, the neutral words and above "
    "all the assassin, which loses the game. The clue must be one word, not on the board, and neither part of a "
    'board word nor containing one. Reply with JSON only: {{"clue": word, "count": number}}'
)
OPERATIVE = (
    "You are the {team} operative in Codenames. Your spymaster gives a one-word clue and a number. Guess "
    "which board words the clue points to, the likeliest first, at most the number plus one. Guessing stops "
    "at the first word that is not your team's, and the assassin loses the game. Reply with JSON only: "
    '{{"guesses": [word, ...]}}'
)


def other(team: str) -> str:
    return "blue" if team == "red" else "red"


@dataclass(frozen=True)
class Board:
    words: tuple[str, ...]  # 25 words
    colors: tuple[str, ...]  # each word's: "red", "blue", "neutral" or "assassin"

    @classmethod
    def deal(cls, seed: int) -> Board:
        """25 words and their colours, the same for the same seed."""
        rng = random.Random(seed)
        colors = [color for color, k in WORDS_PER_COLOR.items() for _ in range(k)]
        rng.shuffle(colors)
        return cls(tuple(rng.sample(BOARD_WORDS, len(colors))), tuple(colors))

    def color(self, word: str) -> str:
        return self.colors[self.words.index(word)]

    def words_of(self, color: str) -> list[str]:
        return [w for w, c in zip(self.words, self.colors, strict=True) if c == color]


def clue_problem(word: Any, count: Any, board_words: Iterable[str]) -> str | None:
    """Why a clue breaks the rules, or None when it is valid. Every board word counts, revealed or not.

    >>> clue_problem("sea", 2, ["seal", "apple"])
    "the clue 'sea' is part of the board word 'seal'"
    """
    if not isinstance(word, str) or not _ONE_WORD.fullmatch(word):
        return f"the clue {word!r} is not one word of letters a-z"
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 9:
        return f"the count {count!r} is not a whole number from 1 to 9"
    for w in board_words:
        if word == w:
            return f"the clue {word!r} is a word on the board"
        if word in w:
            return f"the clue {word!r} is part of the board word {w!r}"
        if w in word:
            return f"the clue {word!r} contains the board word {w!r}"
    return None


def clue_vocabulary(board: Board) -> list[str]:
    """The clue words a constrained spymaster chooses from on this board, every one valid there."""
    words = set(CLUE_WORDS) | set(BOARD_WORDS)
    return sorted(w for w in words if clue_problem(w, 1, board.words) is None)


@dataclass
class Game:
    """The state of one game and its rules; the rollout supplies the moves."""

    board: Board
    max_turns: int = DEFAULT_MAX_TURNS
    team: str = "red"  # whose turn it is
    turns: int = 0  # team turns finished
    revealed: dict[str, str] = field(default_factory=dict)  # word -> the team whose operative revealed it
    clues: list[tuple[str, str, int]] = field(default_factory=list)  # (team, clue, count) of valid clues
    winner: str | None = None  # None while playing, and for a draw
    end: str | None = None  # "words", "assassin" or "turn limit" once the game is over
    log: list[str] = field(default_factory=list)

    @property
    def over(self) -> bool:
        return self.end is not None

    def unrevealed(self) -> list[str]:
        return [w for w in self.board.words if w not in self.revealed]

    def left(self, team: str) -> int:
        return sum(w not in self.revealed for w in self.board.words_of(team))

    def found(self, team: str) -> int:
        return WORDS_PER_COLOR[team] - self.left(team)

    def guess(self, word: str) -> str:
        """Reveal `word` for the team on turn; returns its colour and ends the game where the rules say so."""
        if self.over:
            raise RuntimeError(f"the game is over ({self.end}): no more guesses")
        if word not in self.board.words or word in self.revealed:
            raise ValueError(
                f"{word!r} is not an unrevealed word on the board: guess one of game.unrevealed()"
            )
        self.revealed[word] = self.team
        color = self.board.color(word)
        if color == "assassin":
            self.winner, self.end = other(self.team), "assassin"
        elif color in TEAMS and self.left(color) == 0:
            self.winner, self.end = color, "words"
        return color

    def guesses(self, words: list[str], count: int) -> tuple[list[tuple[str, str]], str | None]:
        """An operative's reply under the rules: repeated words once, at most count + 1, stopping at the first
        word not the team's. Returns the (word, colour) pairs revealed and the problem that stopped it, if
        any."""
        if not words:
            return [], "no word was guessed"
        made: list[tuple[str, str]] = []
        for word in list(dict.fromkeys(words))[: count + 1]:
            if word not in self.board.words or word in self.revealed:
                return made, f"{word!r} is not an unrevealed word on the board"
            color = self.guess(word)
            made.append((word, color))
            if self.over or color != self.team:
                break
        return made, None

    def end_turn(self) -> None:
        """Pass the turn; at the turn limit the team with the larger share of its words revealed wins."""
        if self.over:
            raise RuntimeError(f"the game is over ({self.end}): no more turns")
        self.turns += 1
        self.team = other(self.team)
        if self.turns >= self.max_turns:
            margin = self.margin("red")
            self.winner = None if margin == 0 else "red" if margin > 0 else "blue"
            self.end = "turn limit"

    def margin(self, team: str) -> float:
        """Share of the team's words revealed minus the opponent's share, -1 to 1."""
        opponent = other(team)
        return self.found(team) / WORDS_PER_COLOR[team] - self.found(opponent) / WORDS_PER_COLOR[opponent]

    def outcome(self, team: str) -> float:
        if not self.over:
            raise RuntimeError("the game is not over yet: no outcome")
        return 1.0 if self.winner == team else 0.5 if self.winner is None else 0.0

    def reward(self, team: str, invalid_moves: int) -> float:
        return self.outcome(team) + 0.5 * self.margin(team) - INVALID_PENALTY * invalid_moves

    def public_view(self) -> str:
        """What everyone sees: revealed words with their colours, and the clues so far."""
        revealed = ", ".join(f"{w} ({self.board.color(w)})" for w in self.revealed) or "none"
        clues = ", ".join(f'{team} "{clue}" {count}' for team, clue, count in self.clues) or "none"
        left = f"Words left: red {self.left('red')}, blue {self.left('blue')}"
        return f"Revealed so far: {revealed}\nClues so far: {clues}\n{left}"

    def spymaster_view(self, team: str) -> str:
        def hidden(color: str) -> str:
            return ", ".join(w for w in self.board.words_of(color) if w not in self.revealed) or "none"

        opponent = other(team)
        return (
            f"Your words ({team}): {hidden(team)}\nThe other team's words ({opponent}): {hidden(opponent)}\n"
            f"Neutral words: {hidden('neutral')}\nThe assassin: {hidden('assassin')}\n{self.public_view()}"
        )

    def operative_view(self, clue: str, count: int) -> str:
        return (
            f"Unrevealed words: {', '.join(self.unrevealed())}\n{self.public_view()}\n"
            f'Your spymaster\'s clue: "{clue}" {count}. Guess 1 to {count + 1} words.'
        )


def parse_clue(text: str | None) -> tuple[str, int] | None:
    """(clue word, count) from a reply `{"clue": ..., "count": ...}`, or None when it is not one."""
    data = json_object(text) or {}
    word, count = data.get("clue"), data.get("count")
    if isinstance(count, str) and count.strip().isdigit():
        count = int(count)
    if not isinstance(word, str) or isinstance(count, bool) or not isinstance(count, int):
        return None
    return word.strip().lower(), count


def parse_guesses(text: str | None) -> list[str] | None:
    """The words of a reply `{"guesses": [...]}`, lower-cased, or None when it is not one."""
    guesses = (json_object(text) or {}).get("guesses")
    if not isinstance(guesses, list) or not all(isinstance(g, str) for g in guesses):
        return None
    return [g.strip().lower() for g in guesses]


def clue_schema(board: Board) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "clue": {"type": "string", "enum": clue_vocabulary(board)},
            "count": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["clue", "count"],
        "additionalProperties": False,
    }


def guess_schema(game: Game, count: int) -> dict[str, Any]:
    words = {"type": "string", "enum": game.unrevealed()}
    return {
        "type": "object",
        "properties": {"guesses": {"type": "array", "items": words, "minItems": 1, "maxItems": count + 1}},
        "required": ["guesses"],
        "additionalProperties": False,
    }


@retry(exceptions=TRANSIENT_ERRORS)
async def _ask(
    model: Model,
    messages: list[dict[str, Any]],
    schema: dict[str, Any] | None,
    *,
    max_tokens: int,
    step: int | None,
    temperature: float,
) -> Choice:
    constraint: dict[str, Any] = {}
    if schema is not None:
        constraint["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "move", "schema": schema, "strict": True},
        }
    completion: ChatCompletion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(step),
        # plain chat-format dicts; the SDK types messages as TypedDicts
        messages=cast("list[ChatCompletionMessageParam]", messages),
        max_tokens=max_tokens,
        temperature=temperature,
        logprobs=True,
        **constraint,
    )
    return completion.choices[0]


@dataclass
class _Player:
    """One role of one team during a game: its trajectory (one history per turn) and its tallies."""

    traj: Trajectory
    team: str
    role: str
    invalid: int = 0
    counts: list[int] = field(default_factory=list)  # spymaster: the count of each valid clue
    guesses: int = 0  # operative: words revealed
    correct: int = 0  # operative: of those, the team's own

    def add_turn(self, conversation: list) -> None:
        if self.traj.messages_and_choices:
            self.traj.additional_histories.append(History(messages_and_choices=conversation))
        else:
            self.traj.messages_and_choices = conversation

    def finish(self, game: Game) -> Trajectory:
        team, role, turns = self.team, self.role, self.traj.trainable_turns()
        self.traj.reward = game.reward(team, self.invalid)
        self.traj.metrics.update(
            {
                "win": game.winner == team,
                "draw": game.winner is None,
                "hit_assassin": game.end == "assassin" and game.winner != team,
                "margin": game.margin(team),
                "own_words_found": game.found(team),
                "opponent_words_found": game.found(other(team)),
                "game_turns": game.turns,
                "turns": turns,
                "invalid_moves": self.invalid,
            }
        )
        # A rate over no turns is not a rate: a spymaster whose game ended before their first turn (the other
        # team found the assassin) has none, rather than a 0 that reads as "every clue refused" in the means.
        if role == "spymaster":
            if turns:
                self.traj.metrics["valid_clue_rate"] = len(self.counts) / turns
            if self.counts:
                self.traj.metrics["mean_clue_count"] = sum(self.counts) / len(self.counts)
        else:
            self.traj.metrics["guesses"] = self.guesses
            self.traj.metrics["guess_accuracy"] = self.correct / self.guesses if self.guesses else 0.0
        for line in game.log:
            self.traj.log(line)
        return self.traj.finish()


async def play(
    model: Model,
    scenario: int,
    *,
    step: int | None = None,
    temperature: float = 1.0,
    constrained: bool = True,
    max_turns: int = DEFAULT_MAX_TURNS,
    opponent: Model | None = None,
) -> list[Trajectory]:
    """Play one game on the board `Board.deal(scenario)`; `model` plays all four roles (self-play), or red's
    two when `opponent` is given, which then plays blue's (`step` picks `model`'s checkpoint only).

    Returns four trajectories, red spymaster, red operative, blue spymaster, blue operative, each with
    `metadata` scenario, team and role. A role that never had a turn (the game ended first) has no messages;
    `groups_by_role` leaves it out.

    Example:
        games = await art.gather_trajectories(codenames.play(model, s) for s in range(4) for _ in range(8))
        groups = codenames.groups_by_role(games)
    """
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    game = Game(Board.deal(scenario), max_turns=max_turns)
    players = {
        (team, role): _Player(
            Trajectory(metadata={"scenario": scenario, "team": team, "role": role}), team, role
        )
        for team in TEAMS
        for role in ROLES
    }
    # why a team's last clue was refused, told to its spymaster
    notes: dict[str, str] = dict.fromkeys(TEAMS, "")
    sides = {"red": (model, step), "blue": (opponent, None) if opponent is not None else (model, step)}
    while not game.over:
        team = game.team
        player, checkpoint = sides[team]
        ask = {"step": checkpoint, "temperature": temperature}
        spymaster, operative = players[team, "spymaster"], players[team, "operative"]
        messages = [
            {"role": "system", "content": SPYMASTER.format(team=team)},
            {"role": "user", "content": notes[team] + game.spymaster_view(team)},
        ]
        schema = clue_schema(game.board) if constrained else None
        choice = await _ask(
            player, messages, schema, max_tokens=64, **ask
        )  # room for a weak model spelling JSON piecewise
        spymaster.add_turn([*messages, choice])
        clue = parse_clue(choice.message.content)
        problem = (
            clue_problem(*clue, game.board.words) if clue else 'not JSON {"clue": word, "count": number}'
        )
        if problem:
            spymaster.invalid += 1
            notes[team] = (
                f"Your last clue ({(choice.message.content or '')[:60]!r}) was refused: {problem}.\n"
            )
            game.log.append(f"{team} spymaster: invalid clue, {problem}")
            game.end_turn()
            continue
        assert clue is not None  # no clue is a problem, handled above
        notes[team] = ""
        word, count = clue
        game.clues.append((team, word, count))
        spymaster.counts.append(count)
        messages = [
            {"role": "system", "content": OPERATIVE.format(team=team)},
            {"role": "user", "content": game.operative_view(word, count)},
        ]
        schema = guess_schema(game, count) if constrained else None
        choice = await _ask(player, messages, schema, max_tokens=160, **ask)
        operative.add_turn([*messages, choice])
        words = parse_guesses(choice.message.content)
        made, problem = game.guesses(words, count) if words is not None else ([], "not JSON {guesses: [...]}")
        operative.invalid += int(problem is not None)
        operative.guesses += len(made)
        operative.correct += sum(color == team for _, color in made)
        revealed = ", ".join(f"{w} ({c})" for w, c in made) or "nothing"
        game.log.append(f'{team}: "{word}" {count} -> {revealed}' + (f"; {problem}" if problem else ""))
        if not game.over:
            game.end_turn()
    result = f"{game.winner} wins" if game.winner else "draw"
    game.log.append(
        f"{result} ({game.end}) after {game.turns} turns; words left: red {game.left('red')}, "
        f"blue {game.left('blue')}"
    )
    return [players[team, role].finish(game) for team in TEAMS for role in ROLES]


def groups_by_role(games: Iterable[list[Trajectory] | Trajectory | BaseException]) -> list[TrajectoryGroup]:
    """One group per board, team and role from finished games (e.g. what `art.gather_trajectories` returned
    for `play` calls), in order of first appearance.

    Left out: failed games (exceptions; the gather already counted them against max_exceptions), trajectories
    of a role that never had a turn, and groups left with fewer than 2 trajectories (GRPO cannot compare).
    """
    buckets: dict[tuple[Any, Any, Any], list[Trajectory]] = {}  # (scenario, team, role) from metadata
    for game in games:
        if isinstance(game, BaseException):
            continue
        for traj in [game] if isinstance(game, Trajectory) else game:
            if traj.trainable_turns():
                key = (traj.metadata["scenario"], traj.metadata["team"], traj.metadata["role"])
                buckets.setdefault(key, []).append(traj)
    return [
        TrajectoryGroup(trajs, metadata={"scenario": s, "team": team, "role": role})
        for (s, team, role), trajs in buckets.items()
        if len(trajs) >= 2
    ]


async def self_play_groups(
    model: Model,
    scenarios: Iterable[int],
    *,
    games_per_scenario: int = 4,
    step: int | None = None,
    temperature: float = 1.0,
    constrained: bool = True,
    max_turns: int = DEFAULT_MAX_TURNS,
    max_exceptions: int | float = 0,
) -> list[TrajectoryGroup]:
    """Play `games_per_scenario` games on each board, concurrently, and group them with `groups_by_role`.

    Example:
        groups = await codenames.self_play_groups(model, range(step * 2, step * 2 + 2), games_per_scenario=6)
        await model.train(groups)
    """
    if games_per_scenario < 2:
        raise ValueError(
            f"games_per_scenario must be >= 2 for GRPO to compare games, got {games_per_scenario}"
        )
    games = await gather_trajectories(
        (
            play(model, s, step=step, temperature=temperature, constrained=constrained, max_turns=max_turns)
            for s in scenarios
            for _ in range(games_per_scenario)
        ),
        pbar_desc="codenames",
        max_exceptions=max_exceptions,
    )
    return groups_by_role(games)


async def head_to_head(
    models: Mapping[str, Model],
    scenarios: Iterable[int],
    *,
    temperature: float = 0.0,
    constrained: bool = True,
    max_turns: int = DEFAULT_MAX_TURNS,
    max_exceptions: int | float = 0,
) -> pd.DataFrame:
    """Two models against each other on each board, twice: each plays red (who starts and owns 9 words) once.

    Self-play cannot say whether training helped: the same model is on both sides, so one of its teams wins
    every game. Here the trained model meets the base one on boards neither trained on.

    >>> table = await codenames.head_to_head({"trained": model, "base": model.as_base_model()}, range(10**6, 10**6 + 8))
    >>> art.summarize_evaluation(table, ["win", "margin", "guess_accuracy"])

    Returns one row per role per game, in the shape of `art.evaluate`'s table: `model` (the label), `scenario`,
    `team`, `role`, `reward` and the trajectory's metrics (`win`, `draw`, `margin`, `valid_clue_rate` for
    spymasters, `guess_accuracy` for operatives...). A model's win rate is the mean of `win` over its rows.
    """
    labels = list(models)
    if len(labels) != 2:
        raise ValueError(f"head_to_head needs exactly two models, got {len(labels)}: {labels}")
    scenarios = list(scenarios)
    if not scenarios:
        raise ValueError("head_to_head needs at least one board (scenario)")
    games = [(s, red, blue) for s in scenarios for red, blue in (labels, labels[::-1])]
    played = await gather_trajectories(
        (
            play(
                models[red],
                s,
                opponent=models[blue],
                temperature=temperature,
                constrained=constrained,
                max_turns=max_turns,
            )
            for s, red, blue in games
        ),
        pbar_desc="head to head",
        max_exceptions=max_exceptions,
    )
    rows = []
    for (s, red, blue), result in zip(games, played, strict=True):
        if isinstance(result, BaseException):
            continue
        for traj in [result] if isinstance(result, Trajectory) else result:
            team = traj.metadata["team"]
            rows.append(
                {
                    "model": red if team == "red" else blue,
                    "scenario": s,
                    "team": team,
                    "role": traj.metadata["role"],
                    "reward": traj.reward,
                    **numeric_metrics(traj),
                }
            )
    return pd.DataFrame(rows)
