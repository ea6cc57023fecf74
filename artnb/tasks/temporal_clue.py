"""Temporal Clue: who-what-where-when deduction puzzles from our own generator, answered in one turn.

The story: n guests each spent the evening alone in a different room, carried a different object and arrived
at a different hour; one of them is the culprit. The clues link guests, rooms, objects and hours, many through
time ("the person in the library arrived before 9pm", "the culprit arrived two hours after Bruno"). The
question is the culprit's four facts, so a reply earns partial credit per correct field.

Design choices, and why:
- Verified by brute force: every world (n!^3 assignments x n culprits, 55,296 for n=4) is enumerated once per
  n as numpy arrays, each clue is a boolean mask over them, and a puzzle is kept only when every world that
  satisfies all its clues gives the same answer. Clues are drawn true of a random world, added while they rule
  worlds out until the answer is unique, then dropped again where the answer stays unique without them, so no
  clue is redundant. A plain-Python `holds` states each clue's meaning and the tests check the two agree.
- The culprit is never named outright: clues about the culprit only exclude ("the culprit was not in the
  attic") or order in time, so finding the culprit always takes a deduction.
- `difficulty` 1 has 3 guests; 2 has 4; 3 has 4 and uses direct facts ("Ada had the vase") only where
  relations and exclusions cannot pin the answer down, which makes puzzles longer and more temporal. n stays
  at most 4: n=5 would mean 8.6 million worlds.
- The answer is JSON `{"who", "what", "where", "when"}`. Every field is one of n names, so the well-formed
  answers are few (81 or 256) and `structured_outputs.choice` over their JSON texts constrains the reply on
  both artnb engines and vLLM; a free reply (`constrained=False`) is read by the same parser.
- Reward = correct fields / 4, minus 0.25 when the reply is not a JSON object whose four fields each name one
  of the puzzle's options: an all-wrong answer in the right form beats no answer.
"""

from __future__ import annotations

import functools
import itertools
import json
import random
from dataclasses import dataclass, field

import numpy as np

from ..core.model import Model
from ..core.trajectory import Trajectory
from .replies import ask_choice, json_object

SUSPECTS = ["Ada", "Bruno", "Clara", "Desmond", "Elif", "Farid", "Greta", "Hiro"]
ROOMS = ["library", "kitchen", "study", "cellar", "attic", "greenhouse", "gallery", "pantry"]
OBJECTS = ["scarf", "hammer", "vase", "umbrella", "lantern", "telescope", "teapot", "violin"]
FIELDS = ("who", "what", "where", "when")
ATTRIBUTES = ("room", "object", "hour")
FORMAT_PENALTY = 0.25


@dataclass(frozen=True)
class Difficulty:
    suspects: int  # guests, rooms, objects and hours each: 3 or 4
    direct_facts_last: bool  # use "X had the Y" facts only when nothing else pins the answer down


DIFFICULTIES = {1: Difficulty(3, False), 2: Difficulty(4, False), 3: Difficulty(4, True)}


@dataclass(frozen=True)
class Ref:
    """A way to point at one guest: by name, room, object, arrival hour, or as the culprit."""

    kind: str  # "person", "room", "object", "hour" or "culprit"
    value: int = 0  # index into that kind's names; unused for "culprit"


@dataclass(frozen=True)
class Clue:
    """A true statement about the world. `same`/`different`: a's guest has (not) b's attribute (b is a room,
    object or hour). `earlier`: a's guest arrived before b's. `gap`: a's guest arrived `hours` after b's."""

    kind: str  # "same", "different", "earlier" or "gap"
    a: Ref
    b: Ref
    hours: int = 0


@dataclass(frozen=True)
class World:
    """One full assignment, indexed by guest: room[i], object[i], hour[i] index the puzzle's names."""

    room: tuple[int, ...]
    object: tuple[int, ...]
    hour: tuple[int, ...]
    culprit: int


@dataclass(frozen=True)
class Answer:
    who: str
    what: str
    where: str
    when: str

    def as_json(self) -> str:
        return json.dumps({f: getattr(self, f) for f in FIELDS})


def who(ref: Ref, world: World) -> int:
    """The guest `ref` points at in `world`."""
    if ref.kind == "person":
        return ref.value
    if ref.kind == "culprit":
        return world.culprit
    return getattr(world, ref.kind).index(ref.value)


def holds(clue: Clue, world: World) -> bool:
    """Whether `clue` is true in `world` (the meaning of each clue kind, in plain Python)."""
    a, b = who(clue.a, world), who(clue.b, world)
    if clue.kind == "same":
        return a == b
    if clue.kind == "different":
        return a != b
    if clue.kind == "earlier":
        return world.hour[a] < world.hour[b]
    if clue.kind == "gap":
        return world.hour[a] == world.hour[b] + clue.hours
    raise ValueError(f"unknown clue kind {clue.kind!r}: use same, different, earlier or gap")


@dataclass
class Score:
    correct: dict[str, bool]  # per field
    format_ok: bool  # a JSON object whose four fields each name one of the puzzle's options

    @property
    def correct_fields(self) -> int:
        return sum(self.correct.values())

    @property
    def reward(self) -> float:
        return self.correct_fields / len(FIELDS) - (0.0 if self.format_ok else FORMAT_PENALTY)


@dataclass
class Puzzle:
    seed: int
    difficulty: int
    suspects: list[str]
    rooms: list[str]
    objects: list[str]
    hours: list[str]  # in time order
    clues: list[Clue]
    world: World  # the hidden truth the clues were drawn from
    options: dict[str, list[str]] = field(init=False)

    def __post_init__(self) -> None:
        self.options = dict(zip(FIELDS, (self.suspects, self.objects, self.rooms, self.hours), strict=True))

    @property
    def solution(self) -> Answer:
        return self.answer_in(self.world)

    def answer_in(self, world: World) -> Answer:
        c = world.culprit
        return Answer(
            self.suspects[c],
            self.objects[world.object[c]],
            self.rooms[world.room[c]],
            self.hours[world.hour[c]],
        )

    def describe(self, clue: Clue) -> str:
        """The clue as an English sentence."""
        a, b = self._subject(clue.a), self._subject(clue.b)
        if clue.kind in ("same", "different"):
            name = self._name(clue.b)
            verbs = {"room": ("was in the", "was not in the"), "object": ("had the", "did not have the")}
            verbs["hour"] = ("arrived at", "did not arrive at")
            text = f"{a} {verbs[clue.b.kind][clue.kind == 'different']} {name}"
        elif clue.kind == "earlier" and clue.b.kind == "hour":
            text = f"{a} arrived before {self._name(clue.b)}"
        elif clue.kind == "earlier" and clue.a.kind == "hour":
            text = f"{b} arrived after {self._name(clue.a)}"
        elif clue.kind == "earlier":
            text = f"{a} arrived earlier than {b}"
        else:
            text = f"{a} arrived {clue.hours} hour{'s' if clue.hours > 1 else ''} after {b}"
        return text[0].upper() + text[1:] + "."

    def _name(self, ref: Ref) -> str:
        return {"person": self.suspects, "room": self.rooms, "object": self.objects, "hour": self.hours}[
            ref.kind
        ][ref.value]

    def _subject(self, ref: Ref) -> str:
        if ref.kind == "culprit":
            return "the culprit"
        phrase = {"person": "{}", "room": "the person in the {}", "object": "the person with the {}"}
        phrase["hour"] = "the person who arrived at {}"
        return phrase[ref.kind].format(self._name(ref))

    def prompt(self) -> str:
        clues = "\n".join(f"{i}. {self.describe(c)}" for i, c in enumerate(self.clues, 1))
        return (
            f"{_join(self.suspects)} each spent one evening at Hollin Hall, alone. Each was in a different "
            f"room ({_join(self.rooms)}), carried a different object ({_join(self.objects)}) and arrived at "
            f"a different hour ({_join(self.hours)}). One of them is the culprit.\n\nClues:\n{clues}\n\n"
            "Who is the culprit, what did they carry, where were they, and when did they arrive? Reply with "
            'JSON only: {"who": name, "what": object, "where": room, "when": hour}'
        )

    def answer_choices(self) -> list[str]:
        """Every well-formed answer, as the JSON text a constrained reply must be."""
        return [Answer(*a).as_json() for a in itertools.product(*(self.options[f] for f in FIELDS))]

    def score(self, reply: str | None) -> Score:
        """Partial credit per field of a reply; a malformed reply scores, it never raises."""
        data = json_object(reply)
        truth = self.solution
        correct, format_ok = {}, data is not None
        for f in FIELDS:
            value = _option(data.get(f) if data else None, self.options[f])
            correct[f] = value == getattr(truth, f)
            format_ok = format_ok and value is not None
        return Score(correct, format_ok)


def _join(names: list[str]) -> str:
    return ", ".join(names[:-1]) + " and " + names[-1]


def _option(value: object, options: list[str]) -> str | None:
    """The option `value` names, ignoring case and spaces ("9 PM" is "9pm"), or None."""
    if not isinstance(value, str):
        return None
    key = value.replace(" ", "").lower()
    return next((o for o in options if o.replace(" ", "").lower() == key), None)


@dataclass(frozen=True)
class _Worlds:
    """Every world for n guests as arrays: room, object, hour are (W, n); culprit and answer are (W,)."""

    room: np.ndarray
    object: np.ndarray
    hour: np.ndarray
    culprit: np.ndarray
    answer: np.ndarray  # one int per world encoding (who, what, where, when)

    def who(self, ref: Ref) -> np.ndarray:
        if ref.kind == "person":
            return np.full(len(self.culprit), ref.value)
        if ref.kind == "culprit":
            return self.culprit
        return np.argmax(getattr(self, ref.kind) == ref.value, axis=1)

    def hour_of(self, guests: np.ndarray) -> np.ndarray:
        return np.take_along_axis(self.hour, guests[:, None], axis=1)[:, 0]

    def mask(self, clue: Clue) -> np.ndarray:
        """Which worlds `clue` holds in (the vectorised twin of `holds`)."""
        a, b = self.who(clue.a), self.who(clue.b)
        if clue.kind == "same":
            return a == b
        if clue.kind == "different":
            return a != b
        if clue.kind == "earlier":
            return self.hour_of(a) < self.hour_of(b)
        return self.hour_of(a) == self.hour_of(b) + clue.hours


@functools.cache
def _worlds(n: int) -> _Worlds:
    perms = np.array(list(itertools.permutations(range(n))), dtype=np.int64)
    f = len(perms)
    r, o, h, c = (x.ravel() for x in np.indices((f, f, f, n)))
    room, obj, hour = perms[r], perms[o], perms[h]
    rows = np.arange(len(c))
    answer = ((c * n + obj[rows, c]) * n + room[rows, c]) * n + hour[rows, c]
    return _Worlds(room, obj, hour, c, answer)


def _answer_code(world: World, n: int) -> int:
    c = world.culprit
    return ((c * n + world.object[c]) * n + world.room[c]) * n + world.hour[c]


def _ref_to(guest: int, world: World, rng: random.Random, kinds: tuple[str, ...]) -> Ref:
    """A random way, among `kinds`, to point at `guest` (as the culprit only if they are)."""
    kinds = tuple(k for k in kinds if k != "culprit" or guest == world.culprit)
    kind = rng.choice(kinds)
    value = {"person": guest, "culprit": 0}.get(kind)
    return Ref(kind, getattr(world, kind)[guest] if value is None else value)


def _candidate_clues(world: World, n: int, rng: random.Random, count: int) -> list[Clue]:
    """Random true clues, plus a set that pins down everything (so a unique answer is always reachable)."""
    anyone = ("person", "room", "object", "hour", "culprit")
    clues: list[Clue] = []
    for _ in range(count):
        kind = rng.choice(("same", "different", "earlier", "earlier", "gap"))
        p, q = rng.sample(range(n), 2)
        if kind in ("same", "different"):
            a = _ref_to(p, world, rng, ("person", "room", "object", "hour") if kind == "same" else anyone)
            attribute = rng.choice([k for k in ATTRIBUTES if k != a.kind])
            truth = getattr(world, attribute)[p]
            value = truth if kind == "same" else rng.choice([v for v in range(n) if v != truth])
            clues.append(Clue(kind, a, Ref(attribute, value)))
            continue
        if world.hour[p] > world.hour[q]:
            p, q = q, p  # p arrived first
        if kind == "earlier":
            a = _ref_to(p, world, rng, anyone)
            b = _ref_to(q, world, rng, tuple(k for k in anyone if k != "hour" or a.kind != "hour"))
            clues.append(Clue("earlier", a, b))
        else:
            no_hour = ("person", "room", "object", "culprit")
            a, b = _ref_to(q, world, rng, no_hour), _ref_to(p, world, rng, no_hour)
            clues.append(Clue("gap", a, b, world.hour[q] - world.hour[p]))
    for p in range(n):
        clues.extend(Clue("same", Ref("person", p), Ref(k, getattr(world, k)[p])) for k in ATTRIBUTES)
    others = [v for v in range(n) if v != world.room[world.culprit]]
    clues.extend(Clue("different", Ref("culprit"), Ref("room", v)) for v in others)
    return list(dict.fromkeys(clues))  # unique, in order


def generate_puzzle(seed: int, difficulty: int = 2) -> Puzzle:
    """A uniquely solvable puzzle, the same for the same seed and difficulty.

    >>> p = generate_puzzle(7)
    >>> consistent_answers(p) == {p.solution}
    True
    """
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty must be one of {sorted(DIFFICULTIES)}, got {difficulty!r}")
    level = DIFFICULTIES[difficulty]
    rng = random.Random(seed)
    n = level.suspects
    start = rng.choice((5, 6, 7))
    hours = [f"{start + i}pm" for i in range(n)]
    names = (rng.sample(SUSPECTS, n), rng.sample(ROOMS, n), rng.sample(OBJECTS, n))
    room, object_, hour = (tuple(rng.sample(range(n), n)) for _ in ATTRIBUTES)
    world = World(room, object_, hour, rng.randrange(n))
    pool = _candidate_clues(world, n, rng, count=60)
    rng.shuffle(pool)
    if level.direct_facts_last:
        pool.sort(key=lambda c: c.kind == "same" and c.a.kind == "person")  # stable: the rest stay shuffled
    clues = _minimal_clues(pool, _worlds(n), _answer_code(world, n), rng)
    rng.shuffle(clues)
    puzzle = Puzzle(seed, difficulty, names[0], names[1], names[2], hours, clues, world)
    if not all(holds(c, world) for c in clues):
        raise AssertionError(f"puzzle {seed} has a false clue: a bug in temporal_clue's generator")
    return puzzle


def _minimal_clues(pool: list[Clue], worlds: _Worlds, truth: int, rng: random.Random) -> list[Clue]:
    """Clues from `pool`, in order, while they rule worlds out, until the answer is unique; then drop each
    clue the answer stays unique without."""
    masks: dict[Clue, np.ndarray] = {}
    alive = np.ones(len(worlds.answer), dtype=bool)
    chosen: list[Clue] = []
    for clue in pool:
        masks[clue] = worlds.mask(clue)
        narrowed = alive & masks[clue]
        if narrowed.sum() < alive.sum():
            chosen.append(clue)
            alive = narrowed
            if (worlds.answer[alive] == truth).all():
                break
    else:
        raise AssertionError("the clue pool does not pin the answer down: a bug in temporal_clue's generator")
    for clue in rng.sample(chosen, len(chosen)):
        rest = [c for c in chosen if c != clue]
        alive = np.logical_and.reduce([masks[c] for c in rest]) if rest else np.ones_like(alive)
        if (worlds.answer[alive] == truth).all():
            chosen = rest
    return chosen


def consistent_answers(puzzle: Puzzle) -> set[Answer]:
    """Every answer of a world in which all the puzzle's clues hold (by brute force over all worlds)."""
    worlds = _worlds(len(puzzle.suspects))
    alive = np.logical_and.reduce([worlds.mask(c) for c in puzzle.clues])
    return {puzzle.answer_in(w) for w in _decode(worlds, np.flatnonzero(alive))}


def _decode(worlds: _Worlds, indices: np.ndarray) -> list[World]:
    return [
        World(
            tuple(worlds.room[i].tolist()),
            tuple(worlds.object[i].tolist()),
            tuple(worlds.hour[i].tolist()),
            int(worlds.culprit[i]),
        )
        for i in indices
    ]


SYSTEM = "You solve logic puzzles carefully and answer in the exact format asked for."


async def rollout(
    model: Model,
    scenario: int,
    *,
    step: int | None = None,
    temperature: float = 1.0,
    constrained: bool = True,
    difficulty: int = 2,
) -> Trajectory:
    """Answer the puzzle `generate_puzzle(scenario, difficulty)` in one reply. Returns the scored trajectory.

    Example:
        traj = await temporal_clue.rollout(model, scenario=3, difficulty=1)
    """
    puzzle = generate_puzzle(scenario, difficulty)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": puzzle.prompt()}]
    choice = await ask_choice(
        model,
        messages,
        puzzle.answer_choices(),
        step=step,
        temperature=temperature,
        constrained=constrained,
        max_tokens=64,
        free_max_tokens=512,
    )
    score = puzzle.score(choice.message.content)
    traj = Trajectory(
        messages_and_choices=[*messages, choice],
        reward=score.reward,
        metadata={"scenario": scenario, "difficulty": difficulty, "solution": puzzle.solution.as_json()},
    )
    traj.metrics.update({f"{f}_correct": ok for f, ok in score.correct.items()})
    traj.metrics.update(
        {
            "correct_fields": score.correct_fields,
            "solved": score.correct_fields == len(FIELDS),
            "format_ok": score.format_ok,
            "clues": len(puzzle.clues),
        }
    )
    traj.log(f"answer {choice.message.content!r}, solution {puzzle.solution.as_json()}")
    return traj.finish()
