"""ART·E: an email research agent that answers questions by searching an inbox with tools.

The agent gets a question about its user's inbox ("Where is the team offsite being held now?") and three
tools: `search_inbox` (full-text search with sender, recipient and date filters), `read_email` (one message in
full) and `return_final_answer` (the answer and the message ids it came from). Each tool call is one turn of a
multi-turn conversation; every model reply is a trainable turn. This is the task ART's RULER tutorial trains on,
rebuilt here so that it runs offline, in milliseconds, with a known answer for every question.

Design choices, and why:
- The inbox is generated, not downloaded: a seeded generator writes people, threads with replies, dates, and
  facts planted in specific emails (a budget code, a flight's landing time, an offsite that moved city), next
  to near misses (the offsite's first city, another project's code) and filler mail. Each planted fact comes
  with a question, its answer and the message ids of the emails that state it, so the reward checks against
  ground truth and RULER can be compared with it. `generate_inbox(seed)` is deterministic and takes ~1 ms.
- Scenario `s` is inbox `s` and one of its questions, so the learning benchmark and `art.evaluate` can pass
  plain ints; all rollouts of a group share one inbox, built and indexed once (cached per seed).
- Storage is SQLite with an FTS5 index (stdlib `sqlite3`, in memory): keywords are matched as quoted phrases
  and AND-ed, so a keyword such as "QX-4471" cannot break the query syntax; words are stemmed (Porter), so
  "invoices" finds "invoice"; results are ranked by bm25.
- Tools never raise into the rollout. A bad argument, an unknown message id or a malformed date becomes a tool
  result starting "Error:" that names the problem, the model sees it and may try again, and it counts in
  `metrics["tool_errors"]`.
- The system prompt also describes the tools in words with one example call, because some chat templates
  (SmolLM2's) drop the `tools` list; artnb's engines parse Hermes `<tool_call>` blocks into `tool_calls`.
- `constrained=True` (the default, for artnb's engines and vLLM) asks for each reply as a JSON tool call
  `{"name": ..., "arguments": {...}}` through `response_format` (a JSON schema of the three calls, with short
  strings; the search offers keywords only). Measured: the embedded 135M model, unconstrained, never writes a
  tool call, so every rollout scores the same and GRPO has nothing to learn from; constrained, every reply is
  a call and rewards differ. A reply whose content is such a JSON object counts as a tool call in both modes.
  Pass `constrained=False` for a hosted model, which calls the tools natively.
- Reward (partial credit, ordered so that, all else equal, right answer + right sources > right answer alone
  > wrong answer > no answer):
    answered:     answer_score + 0.25 * sources_ok - penalty
    not answered: -0.5 + 0.1 * found_source + 0.1 * read_source - penalty
  answer_score is 1 when the normalised reply contains the answer (or an accepted form such as "2:05 pm" for
  "14:05"), else half the share of the answer's words it contains; replies over 40 words score 0 (an answer,
  not a dump of the inbox). sources_ok: the returned ids include every ground-truth id. penalty = 0.05 per
  tool error + 0.02 per turn after the first (answered only: charging turns without an answer would pay a
  model to give up early), at most 0.2, so it only orders trajectories within a tier. The small credits for
  a search whose results include a source email and for reading one give a weak model something to climb
  before it ever answers.
"""

from __future__ import annotations

import functools
import inspect
import json
import random
import re
import sqlite3
from dataclasses import dataclass, field
from datetime import date, datetime, time, timedelta
from typing import TYPE_CHECKING, Any, cast

from openai.types.chat.chat_completion import Choice

from ..core.gather import retry
from ..core.model import Model
from ..core.trajectory import Trajectory
from .replies import TRANSIENT_ERRORS

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletion, ChatCompletionMessageParam, ChatCompletionToolParam

# What the learning benchmark and evaluation tables report for this task.
METRICS = ["reward", "correct", "sources_ok", "answered", "tool_errors", "turns"]
# `rollout(model, s, **QUICK)`: small inboxes, short replies, two turns (search, then answer from the
# snippets); a group of the 135M model takes a few seconds on a CPU.
QUICK: dict[str, int] = {"max_turns": 2, "max_tokens": 64, "n_emails": 12}

SOURCES_BONUS = 0.25  # returning every ground-truth message id
NO_ANSWER = -0.5  # below any answer, so answering is always worth it
PROGRESS_CREDIT = 0.1  # each of: a source email in search results, reading one (only when not answered)
TURN_PENALTY = 0.02  # per model reply after the first, when the episode ends with an answer
ERROR_PENALTY = 0.05  # per tool call that returned an error
MAX_PENALTY = 0.2  # penalties order trajectories within a tier, never across tiers
MAX_ANSWER_WORDS = 40

COMPANY = "northwind.example"  # .example domains: never a real address
FIRST_NAMES = [
    "Priya", "Tomas", "Aiko", "Marcus", "Lena", "Omar", "Sofia", "Jonas", "Mei", "Diego",
    "Hanna", "Kwame", "Ines", "Ravi", "Elena", "Felix", "Nadia", "Yusuf", "Clara", "Bjorn",
]  # fmt: skip
LAST_NAMES = [
    "Patel", "Novak", "Tanaka", "Reed", "Fischer", "Haddad", "Rossi", "Berg", "Chen", "Alvarez",
    "Kowalski", "Mensah", "Duarte", "Iyer", "Petrova", "Lindqvist", "Okafor", "Sato", "Moreau", "Quinn",
]  # fmt: skip
CITIES = ["Lisbon", "Porto", "Valencia", "Ljubljana", "Tallinn", "Krakow", "Gothenburg", "Bologna", "Ghent"]
PROJECTS = ["Atlas", "Beacon", "Cobalt", "Ember", "Falcon", "Granite", "Juniper", "Meridian"]
ROOMS = ["Maple", "Birch", "Cedar", "Willow", "Aspen", "Rowan", "Hazel"]
PLACES = ["bike room", "server room", "supply closet", "roof terrace", "parking garage"]
RESTAURANTS = ["Casa Verde", "The Copper Pot", "Sakura House", "Luna Trattoria", "Blue Fig", "Old Mill Grill"]
ROLES = [
    "data engineer",
    "product designer",
    "QA lead",
    "account manager",
    "security analyst",
    "UX researcher",
]
REPORTS = ["quarterly forecast", "vendor audit", "hiring plan", "security review", "roadmap draft"]
VENDORS = ["ledgerworks", "brightcatering", "harbourtravel", "quillprint"]
FILLER = [
    (
        "Weekly digest",
        "This week: the new coffee machine is installed on floor 2, and the all-hands moved online.",
    ),
    ("IT maintenance window", "Email and VPN may be slow on Saturday night while we patch the servers."),
    ("Lunch & learn", "Join us Thursday for a short talk on writing better design docs. Pizza provided."),
    ("Expense reports", "Friendly reminder to file last month's expense reports before the 5th."),
    ("Book club", "Next month we read a novel about lighthouses. Copies are in the kitchen."),
    ("Parking lot", "The east parking lot is closed for resurfacing next week; use the west entrance."),
    ("Quick question", "Do you have the slides from yesterday's sync? I could not find them on the drive."),
    ("Thanks!", "Thanks for the help with the spreadsheet earlier, it saved me an afternoon."),
    ("Fire drill", "There will be a short fire drill on Wednesday morning. Please follow the wardens."),
    ("Plants", "Whoever has been watering the office plants: thank you, the ficus is thriving."),
]


@dataclass(frozen=True)
class Person:
    name: str
    address: str

    def __str__(self) -> str:
        return f"{self.name} <{self.address}>"


@dataclass(frozen=True)
class Email:
    message_id: str
    sent: datetime
    sender: Person
    to: tuple[Person, ...]
    subject: str
    body: str
    cc: tuple[Person, ...] = ()

    def render(self) -> str:
        """The email as `read_email` shows it."""
        lines = [
            f"Message-ID: {self.message_id}",
            f"Date: {self.sent:%Y-%m-%d %H:%M}",
            f"From: {self.sender}",
            f"To: {', '.join(map(str, self.to))}",
        ]
        if self.cc:
            lines.append(f"Cc: {', '.join(map(str, self.cc))}")
        return "\n".join([*lines, f"Subject: {self.subject}", "", self.body])


@dataclass(frozen=True)
class Question:
    question: str
    answer: str
    source_ids: tuple[str, ...]  # the emails that state the answer
    accepted: tuple[str, ...] = ()  # other ways to write the answer ("2:05 pm" for "14:05")


@dataclass(frozen=True)
class Scenario:
    """One question about one generated inbox: what a rollout is asked, and the ground truth it is scored on."""

    seed: int  # the inbox's seed; `get_scenario(seed)` rebuilds this
    question: str
    answer: str
    source_ids: tuple[str, ...]
    accepted: tuple[str, ...]
    owner: Person  # whose inbox it is
    today: date
    n_emails: int
    n_facts: int

    def inbox(self) -> Inbox:
        return generate_inbox(self.seed, self.n_emails, self.n_facts)


class ToolError(ValueError):
    """A tool call the inbox cannot serve; the rollout shows its message to the model as the tool's result."""


@dataclass
class Inbox:
    """Generated mail with the questions it can answer. Search and read through its SQLite FTS5 index."""

    seed: int
    owner: Person
    people: list[Person]
    today: date
    emails: list[Email]
    questions: list[Question]
    _db: sqlite3.Connection | None = field(default=None, repr=False, compare=False)

    def email(self, message_id: str) -> Email:
        """The email with this id; "<id@host>" and "id@host" both find it."""
        for email in self.emails:
            if _bare_id(email.message_id) == _bare_id(message_id):
                return email
        raise ToolError(f"no email has message_id {message_id!r}; use a message_id from search_inbox results")

    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            self._db = _index(self.emails)
        return self._db

    def search_inbox(
        self,
        keywords: list[str],
        from_addr: str | None = None,
        to_addr: str | None = None,
        sent_after: str | None = None,
        sent_before: str | None = None,
        max_results: int = 5,
    ) -> list[dict[str, str]]:
        """Emails containing every keyword (in subject, body or names) that pass the filters, best match first.

        `from_addr`/`to_addr` match part of a name or address ("priya", "@ledgerworks"); `to_addr` also
        matches Cc. `sent_after` is inclusive and `sent_before` exclusive, both "YYYY-MM-DD". Raises ToolError.

        >>> generate_inbox(0).search_inbox(["offsite"], sent_after="2026-01-01")
        """
        if isinstance(keywords, str):
            keywords = keywords.split()
        if not isinstance(keywords, list) or not all(isinstance(k, str) for k in keywords):
            raise ToolError(f"keywords must be a list of strings, got {keywords!r}")
        keywords = [k.strip() for k in keywords if k.strip()]
        if not keywords and not (from_addr or to_addr or sent_after or sent_before):
            raise ToolError("give at least one keyword (or a from_addr/to_addr/date filter)")
        if isinstance(max_results, bool) or not isinstance(max_results, int) or not 1 <= max_results <= 50:
            raise ToolError(f"max_results must be an integer from 1 to 50, got {max_results!r}")
        where, params = [], []
        for column, value in (("e.sender", from_addr), ("e.recipients", to_addr)):
            if value is not None:
                if not isinstance(value, str):
                    raise ToolError(f"address filters must be strings, got {value!r}")
                where.append(f"{column} LIKE ?")
                params.append(f"%{value.strip()}%")
        for op, value in ((">=", sent_after), ("<", sent_before)):
            if value is not None:
                where.append(f"e.sent {op} ?")
                params.append(_parse_date(value).isoformat())
        if keywords:
            query = " AND ".join('"' + k.replace('"', '""') + '"' for k in keywords)
            sql = (
                "SELECT e.message_id, e.subject, e.sent, e.sender, snippet(fts, 1, '', '', ' ... ', 16) "
                "FROM fts JOIN emails e ON e.rowid = fts.rowid WHERE fts MATCH ?"
                + "".join(f" AND {w}" for w in where)
                + " ORDER BY bm25(fts) LIMIT ?"
            )
            params = [query, *params]
        else:
            sql = (
                "SELECT e.message_id, e.subject, e.sent, e.sender, substr(e.body, 1, 100) FROM emails e"
                + (" WHERE " + " AND ".join(where) if where else "")
                + " ORDER BY e.sent DESC LIMIT ?"
            )
        try:
            rows = self.db.execute(sql, [*params, max_results]).fetchall()
        except sqlite3.OperationalError as exc:
            raise ToolError(
                f"could not search for {keywords!r} ({exc}); use plain words as keywords"
            ) from exc
        return [
            {"message_id": m, "subject": s, "date": d[:16].replace("T", " "), "from": f, "snippet": snip}
            for m, s, d, f, snip in rows
        ]

    def read_email(self, message_id: str) -> str:
        """The full email (headers and body). Raises ToolError for an unknown id."""
        if not isinstance(message_id, str):
            raise ToolError(f"message_id must be a string, got {message_id!r}")
        return self.email(message_id.strip()).render()


def _bare_id(message_id: str) -> str:
    return message_id.strip().strip("<>").strip()


def _parse_date(value: Any) -> date:
    try:
        return datetime.fromisoformat(str(value).strip()).date()
    except ValueError:
        raise ToolError(
            f"could not read the date {value!r}; write dates as YYYY-MM-DD, e.g. 2026-03-14"
        ) from None


def _index(emails: list[Email]) -> sqlite3.Connection:
    """An in-memory SQLite database: the emails table and an FTS5 index over subject, body and people."""
    db = sqlite3.connect(":memory:", check_same_thread=False)
    try:
        db.execute("CREATE VIRTUAL TABLE fts USING fts5(subject, body, people, tokenize='porter unicode61')")
    except sqlite3.OperationalError as exc:
        raise RuntimeError(
            "this Python's sqlite3 was built without FTS5, which the email agent's search needs; "
            "install a Python whose SQLite has FTS5 (python.org, conda and most Linux builds do)"
        ) from exc
    db.execute(
        "CREATE TABLE emails (rowid INTEGER PRIMARY KEY, message_id TEXT UNIQUE, sent TEXT, sender TEXT, "
        "recipients TEXT, subject TEXT, body TEXT)"
    )
    for rowid, e in enumerate(emails, start=1):
        recipients = ", ".join(map(str, e.to + e.cc))
        db.execute(
            "INSERT INTO emails VALUES (?, ?, ?, ?, ?, ?, ?)",
            (rowid, e.message_id, e.sent.isoformat(), str(e.sender), recipients, e.subject, e.body),
        )
        db.execute(
            "INSERT INTO fts (rowid, subject, body, people) VALUES (?, ?, ?, ?)",
            (rowid, e.subject, e.body, f"{e.sender} {recipients}"),
        )
    db.commit()
    return db


# ---- the generator ----------------------------------------------------------------------------------------


class _Writer:
    """Collects one inbox's emails while the fact planters run, handing out ids and dates."""

    def __init__(self, rng: random.Random, owner: Person, colleagues: list[Person], today: date) -> None:
        self.rng, self.owner, self.colleagues, self.today = rng, owner, colleagues, today
        self.emails: list[Email] = []
        self.ids: set[str] = set()

    def when(self, days_ago: tuple[int, int]) -> datetime:
        day = self.today - timedelta(days=self.rng.randint(*days_ago))
        return datetime.combine(
            day, time(self.rng.randint(7, 19), self.rng.choice([0, 5, 15, 20, 30, 40, 45]))
        )

    def person(self, *exclude: Person) -> Person:
        return self.rng.choice([p for p in self.colleagues if p not in exclude])

    def future(self, lo: int, hi: int) -> date:
        return self.today + timedelta(days=self.rng.randint(lo, hi))

    def add(self, sender: Person, subject: str, body: str, sent: datetime, cc: int = 0) -> str:
        message_id = f"<{self.rng.getrandbits(32):08x}@{COMPANY}>"
        while message_id in self.ids:
            message_id = f"<{self.rng.getrandbits(32):08x}@{COMPANY}>"
        self.ids.add(message_id)
        others = [p for p in self.colleagues if p != sender]
        copied = tuple(self.rng.sample(others, cc))
        to = (self.owner,) if sender != self.owner else (self.person(),)
        self.emails.append(Email(message_id, sent, sender, to, subject, body.strip(), copied))
        return message_id

    def reply(self, original_id: str, sender: Person, body: str, after_days: int) -> str:
        original = next(e for e in self.emails if e.message_id == original_id)
        sent = original.sent + timedelta(days=after_days, minutes=self.rng.randint(5, 300))
        quoted = "\n".join("> " + line for line in original.body.splitlines()[:2])
        return self.add(
            sender,
            f"Re: {original.subject}",
            f"{body}\n\nOn {original.sent:%b %d}, {original.sender.name} wrote:\n{quoted}",
            min(sent, _end_of(self.today)),
            cc=1,
        )


def _end_of(day: date) -> datetime:
    return datetime.combine(day, time(8, 0))


def _long_date(d: date) -> str:
    return f"{d:%A}, {d:%B} {d.day}"


def _date_forms(d: date) -> tuple[str, ...]:
    return (f"{d:%B} {d.day}", f"{d.day} {d:%B}", d.isoformat(), f"{d:%b} {d.day}", f"{d.day} {d:%b}")


def _offsite(w: _Writer) -> Question:
    organiser, old, new = w.person(), *w.rng.sample(CITIES, 2)
    when = w.future(20, 60)
    first = w.add(
        organiser,
        "Team offsite planning",
        f"""
Hi all, we are planning this year's team offsite in {old} on {_long_date(when)}. Hotel details to follow.
Please block the two days in your calendar.""",
        w.when((20, 40)),
        cc=2,
    )
    update = w.reply(
        first,
        organiser,
        f"Change of plan: the offsite moved to {new}. The venue in {old} fell "
        "through, the dates stay the same.",
        after_days=w.rng.randint(3, 12),
    )
    return Question("Where is the team offsite being held now?", new, (update,))


def _budget_code(w: _Writer) -> Question:
    finance = w.person()
    project, other = w.rng.sample(PROJECTS, 2)
    code, other_code = (
        f"{w.rng.choice('QWXZKV')}{w.rng.choice('XRTM')}-{w.rng.randint(1000, 9999)}" for _ in "ab"
    )
    quarter = w.rng.randint(1, 4)
    source = w.add(
        finance,
        f"Budget codes for Q{quarter}",
        f"""
Hello, for Q{quarter} please charge {project} expenses to budget code {code}. The {other} project keeps using
{other_code}. Ask me if an invoice does not fit either.""",
        w.when((5, 30)),
        cc=1,
    )
    return Question(f"Which budget code should {project} expenses be charged to?", code, (source,))


def _flight(w: _Writer) -> Question:
    traveller = w.person()
    city = w.rng.choice(CITIES)
    hour, minute = w.rng.randint(6, 22), w.rng.choice([5, 10, 20, 35, 45, 50])
    flight = f"{w.rng.choice(['TP', 'LH', 'KL', 'SK', 'IB'])}{w.rng.randint(100, 999)}"
    day = w.future(2, 14)
    source = w.add(
        traveller,
        "Flight details",
        f"""
My flight {flight} from {city} lands at {hour:02d}:{minute:02d} on {_long_date(day)}. Could someone pick me up
at arrivals? I will have the demo hardware with me.""",
        w.when((1, 10)),
    )
    twelve = f"{(hour - 1) % 12 + 1}:{minute:02d} {'am' if hour < 12 else 'pm'}"
    first = traveller.name.split()[0]
    return Question(
        f"What time does {first}'s flight land?", f"{hour:02d}:{minute:02d}", (source,), (twelve,)
    )


def _meeting_room(w: _Writer) -> Question:
    organiser = w.person()
    project, other = w.rng.sample(PROJECTS, 2)
    room, other_room = w.rng.sample(ROOMS, 2)
    day = w.future(1, 10)
    source = w.add(
        organiser,
        f"{project} design review",
        f"""
The {project} design review on {_long_date(day)} will be in the {room} room on the third floor. Bring your
questions; the deck is on the shared drive.""",
        w.when((1, 15)),
        cc=2,
    )
    w.add(
        w.person(organiser),
        f"{other} design review",
        f"We booked the {other_room} room for the {other} design review. Coffee will be there.",
        w.when((1, 15)),
        cc=1,
    )
    return Question(f"Which room is the {project} design review in?", room, (source,), (f"{room} room",))


def _deadline(w: _Writer) -> Question:
    manager = w.person()
    report = w.rng.choice(REPORTS)
    due = w.future(3, 30)
    source = w.add(
        manager,
        f"{report.capitalize()} deadline",
        f"""
Quick reminder that the {report} is now due on {_long_date(due)}. Send me a draft a few days before if you
can.""",
        w.when((1, 12)),
    )
    return Question(f"When is the {report} due?", f"{due:%B} {due.day}", (source,), _date_forms(due))


def _door_code(w: _Writer) -> Question:
    facilities = w.person()
    place, other = w.rng.sample(PLACES, 2)
    code, other_code = (str(w.rng.randint(1000, 9999)) for _ in "ab")
    source = w.add(
        facilities,
        f"New door code for the {place}",
        f"""
From Monday the door code for the {place} is {code}. Please do not write it on the door.""",
        w.when((2, 25)),
    )
    w.add(
        facilities, f"Door code: {other}", f"The {other} now opens with code {other_code}.", w.when((2, 25))
    )
    return Question(f"What is the door code for the {place}?", code, (source,))


def _dinner(w: _Writer) -> Question:
    host = w.person()
    restaurant = w.rng.choice(RESTAURANTS)
    day, guests = w.future(2, 20), w.rng.randint(6, 14)
    source = w.add(
        host,
        "Team dinner",
        f"""
I booked {restaurant} for {guests} people at 19:30 on {_long_date(day)}. Let me know about dietary needs.""",
        w.when((1, 15)),
        cc=3,
    )
    return Question("Which restaurant is the team dinner booked at?", restaurant, (source,))


def _new_hire(w: _Writer) -> Question:
    hr = w.person()
    taken = {p.name.split()[0] for p in (w.owner, *w.colleagues)}
    newcomer = f"{w.rng.choice([f for f in FIRST_NAMES if f not in taken])} {w.rng.choice(LAST_NAMES)}"
    role = w.rng.choice(ROLES)
    day = w.future(3, 25)
    source = w.add(
        hr,
        f"Welcome {newcomer.split()[0]}!",
        f"""
Please welcome {newcomer}, who joins us on {_long_date(day)} as our new {role}. Say hello when you see them
around.""",
        w.when((1, 20)),
        cc=2,
    )
    return Question(f"What role is {newcomer} joining as?", role, (source,))


def _invoice(w: _Writer) -> Question:
    vendor = w.rng.choice(VENDORS)
    sender = Person(f"{vendor.capitalize()} Billing", f"billing@{vendor}.example")
    number = f"INV-{w.rng.randint(10000, 99999)}"
    amount = w.rng.randint(800, 19999)
    source = w.add(
        sender,
        f"Invoice {number}",
        f"""
Dear customer, attached is invoice {number} for {amount:,} EUR, payable within 30 days. Thank you for your
business.""",
        w.when((1, 30)),
    )
    return Question(f"What is the amount on invoice {number}?", f"{amount:,} EUR", (source,), (str(amount),))


PLANTERS = [
    _offsite,
    _budget_code,
    _flight,
    _meeting_room,
    _deadline,
    _door_code,
    _dinner,
    _new_hire,
    _invoice,
]


@functools.lru_cache(maxsize=128)
def generate_inbox(seed: int, n_emails: int = 30, n_facts: int = 4) -> Inbox:
    """The inbox of `seed`: `n_facts` planted facts (each with a question), their near misses, and filler mail
    up to `n_emails`. Deterministic per arguments and cached, so a group's rollouts share one index.

    >>> inbox = generate_inbox(7, n_emails=12)
    >>> inbox.questions[0].question, inbox.questions[0].answer
    """
    if not 1 <= n_facts <= len(PLANTERS):
        raise ValueError(f"n_facts={n_facts}: choose 1 to {len(PLANTERS)} (one per kind of planted fact)")
    rng = random.Random(seed)
    # Unique first names, so "Mei's flight" names one person.
    names = zip(rng.sample(FIRST_NAMES, 9), rng.sample(LAST_NAMES, 9), strict=True)
    people = [Person(f"{f} {ln}", f"{f.lower()}.{ln.lower()}@{COMPANY}") for f, ln in names]
    owner, colleagues = people[0], people[1:]
    today = date(2026, 1, 5) + timedelta(days=rng.randint(0, 330))
    writer = _Writer(rng, owner, colleagues, today)
    questions = [plant(writer) for plant in rng.sample(PLANTERS, n_facts)]
    if len(writer.emails) > n_emails:
        raise ValueError(
            f"n_emails={n_emails} is too small for {n_facts} facts: they need {len(writer.emails)}"
        )
    while len(writer.emails) < n_emails:
        subject, body = rng.choice(FILLER)
        writer.add(writer.person(), subject, body, writer.when((0, 45)), cc=rng.randint(0, 2))
    emails = sorted(writer.emails, key=lambda e: e.sent)
    return Inbox(seed, owner, people, today, emails, questions)


def get_scenario(seed: int, n_emails: int = 30, n_facts: int = 4) -> Scenario:
    """Scenario `seed`: one question (chosen by the seed) about inbox `seed`."""
    inbox = generate_inbox(seed, n_emails, n_facts)
    q = random.Random(f"question-{seed}").choice(inbox.questions)
    return Scenario(
        seed, q.question, q.answer, q.source_ids, q.accepted, inbox.owner, inbox.today, n_emails, n_facts
    )


# ---- tools --------------------------------------------------------------------------------------------------

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "search_inbox",
            "description": "Search the inbox. Returns matching emails (message_id, subject, date, sender, snippet), "
            "best match first. Every keyword must appear.",
            "parameters": {
                "type": "object",
                "properties": {
                    "keywords": {
                        "type": "array",
                        "items": {"type": "string"},
                        "description": "words to find",
                    },
                    "from_addr": {"type": "string", "description": "part of the sender's name or address"},
                    "to_addr": {"type": "string", "description": "part of a recipient's name or address"},
                    "sent_after": {"type": "string", "description": "YYYY-MM-DD, inclusive"},
                    "sent_before": {"type": "string", "description": "YYYY-MM-DD, exclusive"},
                    "max_results": {"type": "integer", "description": "1 to 50, default 5"},
                },
                "required": ["keywords"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_email",
            "description": "Read one email in full, by the message_id that search_inbox returned.",
            "parameters": {
                "type": "object",
                "properties": {"message_id": {"type": "string"}},
                "required": ["message_id"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "return_final_answer",
            "description": "Give the final answer and the message_ids of the emails it comes from. Ends the task.",
            "parameters": {
                "type": "object",
                "properties": {
                    "answer": {"type": "string", "description": "short answer to the question"},
                    "sources": {"type": "array", "items": {"type": "string"}, "description": "message_ids"},
                },
                "required": ["answer", "sources"],
            },
        },
    },
]
TOOL_NAMES = [t["function"]["name"] for t in TOOLS]

SYSTEM = """You are an email research assistant for {owner}. Today is {today:%A, %B %d, %Y}.
Answer the user's question from their inbox, using the tools:
- search_inbox(keywords, from_addr, to_addr, sent_after, sent_before, max_results): find emails
- read_email(message_id): read one email in full
- return_final_answer(answer, sources): give a short answer and the message_ids it comes from; this ends the task
Search with a few words from the question, read the most relevant email, then answer.
Call one tool per reply, for example:
{example}"""
EXAMPLE_CALL = '{"name": "search_inbox", "arguments": {"keywords": ["invoice"]}}'


def _call_schema(name: str, properties: dict[str, Any]) -> dict[str, Any]:
    arguments = {"type": "object", "properties": properties, "required": list(properties)}
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": {**arguments, "additionalProperties": False}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


_SHORT = {"type": "string", "maxLength": 40}  # a message id is 28 characters
_KEYWORD = {"type": "string", "maxLength": 20}
# One tool call as a JSON reply (`constrained=True`): short strings keep a small model's replies short.
TOOL_CALL_SCHEMA: dict[str, Any] = {
    "anyOf": [
        _call_schema(
            "search_inbox", {"keywords": {"type": "array", "items": _KEYWORD, "minItems": 1, "maxItems": 3}}
        ),
        _call_schema("read_email", {"message_id": _SHORT}),
        _call_schema(
            "return_final_answer",
            {
                "answer": {"type": "string", "maxLength": 80},
                "sources": {"type": "array", "items": _SHORT, "maxItems": 3},
            },
        ),
    ]
}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str | dict[str, Any]


def tool_calls_of(choice: Choice, turn: int) -> list[ToolCall]:
    """The reply's tool calls: native `tool_calls`, else a content that is one JSON `{"name", "arguments"}`."""
    if choice.message.tool_calls:
        return [
            ToolCall(c.id, c.function.name, c.function.arguments)
            if c.type == "function"
            else ToolCall(c.id, c.custom.name, c.custom.input)  # a custom tool call: free-text input
            for c in choice.message.tool_calls
        ]
    try:
        data = json.loads((choice.message.content or "").strip())
    except json.JSONDecodeError:
        return []
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return []
    return [ToolCall(f"json_call_{turn}", data["name"], data.get("arguments") or {})]


@dataclass
class Episode:
    """The state of one rollout's tool use: what was called, what failed, and the final answer if given."""

    inbox: Inbox
    scenario: Scenario
    answer: str | None = None
    sources: list[str] = field(default_factory=list)
    tool_errors: int = 0
    seen_ids: set[str] = field(default_factory=set)  # every message_id search results showed
    read_ids: set[str] = field(default_factory=set)

    @property
    def done(self) -> bool:
        return self.answer is not None

    def call(self, name: str, arguments: str | dict[str, Any] | None) -> str:
        """Run one tool call and return what the model sees; a bad call returns "Error: ..." and is counted."""
        try:
            return self._call(name, arguments)
        except ToolError as exc:
            self.tool_errors += 1
            return f"Error: {exc}"

    def _call(self, name: str, arguments: str | dict[str, Any] | None) -> str:
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError as exc:
                raise ToolError(f"the arguments of {name} are not valid JSON ({exc})") from None
        arguments = arguments or {}
        if not isinstance(arguments, dict):
            raise ToolError(f"the arguments of {name} must be a JSON object, got {arguments!r}")
        if name not in TOOL_NAMES:
            raise ToolError(f"there is no tool {name!r}; the tools are {', '.join(TOOL_NAMES)}")
        tool = {"search_inbox": self.inbox.search_inbox, "read_email": self.inbox.read_email}.get(
            name, self._final_answer
        )
        try:
            inspect.signature(tool).bind(**arguments)
        except TypeError as exc:  # a missing or unexpected argument name
            raise ToolError(f"bad arguments for {name}: {exc}") from None
        if name == "search_inbox":
            results = self.inbox.search_inbox(**arguments)
            self.seen_ids |= {r["message_id"] for r in results}
            return json.dumps(results) if results else "No emails match. Try fewer or other keywords."
        if name == "read_email":
            text = self.inbox.read_email(**arguments)
            self.read_ids.add(self.inbox.email(arguments["message_id"]).message_id)
            return text
        return self._final_answer(**arguments)

    def _final_answer(self, answer: str, sources: list[str] | None = None) -> str:
        if not isinstance(answer, str):
            raise ToolError(f"answer must be a string, got {answer!r}")
        sources = [sources] if isinstance(sources, str) else sources or []
        if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
            raise ToolError(f"sources must be a list of message_id strings, got {sources!r}")
        self.answer, self.sources = answer, [s.strip() for s in sources]  # kept as given, matched by _bare_id
        return "Final answer recorded."


def _normalise(text: str) -> str:
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text.casefold()).split())


def answer_score(reply: str, answer: str, accepted: tuple[str, ...] = ()) -> float:
    """1.0 when the reply contains the answer (or an accepted form), else half the share of the answer's words
    present; 0 for replies over 40 words.

    >>> answer_score("It lands at 14:05.", "14:05"), answer_score("4471", "QX-4471")
    (1.0, 0.25)
    """
    said = _normalise(reply)
    if len(said.split()) > MAX_ANSWER_WORDS:
        return 0.0
    padded = f" {said} "
    if any(f" {_normalise(form)} " in padded for form in (answer, *accepted) if _normalise(form)):
        return 1.0
    words = _normalise(answer).split()
    return 0.5 * sum(w in said.split() for w in words) / len(words) if words else 0.0


@dataclass(frozen=True)
class Score:
    reward: float
    answer_score: float  # 0..1, see `answer_score`
    sources_ok: bool
    penalty: float


def score_episode(episode: Episode, turns: int) -> Score:
    """The reward of a finished episode; the module docstring gives the formula and why."""
    s = episode.scenario
    # Without an answer, extra turns are not charged: that would pay a model to stop searching early.
    extra_turns = max(0, turns - 1) if episode.answer is not None else 0
    penalty = min(MAX_PENALTY, TURN_PENALTY * extra_turns + ERROR_PENALTY * episode.tool_errors)
    if episode.answer is None:
        sources = set(s.source_ids)
        progress = PROGRESS_CREDIT * (bool(episode.seen_ids & sources) + bool(episode.read_ids & sources))
        return Score(NO_ANSWER + progress - penalty, 0.0, False, penalty)
    correctness = answer_score(episode.answer, s.answer, s.accepted)
    sources_ok = {_bare_id(i) for i in s.source_ids} <= {_bare_id(i) for i in episode.sources}
    return Score(correctness + SOURCES_BONUS * sources_ok - penalty, correctness, sources_ok, penalty)


# ---- the rollout --------------------------------------------------------------------------------------------


@retry(exceptions=TRANSIENT_ERRORS)
async def _ask(
    model: Model,
    messages: list[dict[str, Any]],
    step: int | None,
    temperature: float,
    max_tokens: int,
    constrained: bool,
) -> Choice:
    constraint: dict[str, Any] = {}
    if constrained:
        constraint["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "tool_call", "schema": TOOL_CALL_SCHEMA},
        }
    completion: ChatCompletion = await model.openai_client().chat.completions.create(
        **constraint,
        model=model.get_inference_name(step),
        # plain chat-format dicts; the SDK types messages and tools as TypedDicts
        messages=cast("list[ChatCompletionMessageParam]", messages),
        tools=cast("list[ChatCompletionToolParam]", TOOLS),
        logprobs=True,
        temperature=temperature,
        max_tokens=max_tokens,
    )
    return completion.choices[0]


async def rollout(
    model: Model,
    scenario: Scenario | int,
    *,
    step: int | None = None,
    temperature: float = 1.0,
    max_turns: int = 8,
    max_tokens: int = 256,
    n_emails: int = 30,
    constrained: bool = True,
) -> Trajectory:
    """Answer one question by searching the inbox with tools; returns the scored trajectory.

    `scenario` is a `Scenario` or a seed (`get_scenario(seed, n_emails)`). The loop stops at return_final_answer,
    at a reply without a tool call, or after `max_turns` replies. `**QUICK` for the 135M model on a CPU;
    `constrained=False` for a hosted model (see the module notes).

    Example:
        traj = await email_agent.rollout(model, 3, max_turns=4)
        traj.reward, traj.metrics["correct"]
    """
    if max_turns < 1:
        raise ValueError(f"max_turns={max_turns}: the agent needs at least one reply")
    s = scenario if isinstance(scenario, Scenario) else get_scenario(scenario, n_emails)
    episode = Episode(s.inbox(), s)
    traj = Trajectory(
        messages_and_choices=[
            {
                "role": "system",
                "content": SYSTEM.format(
                    owner=s.owner,
                    today=s.today,
                    example=EXAMPLE_CALL if constrained else f"<tool_call>{EXAMPLE_CALL}</tool_call>",
                ),
            },
            {"role": "user", "content": s.question},
        ],
        tools=TOOLS,
        metadata={
            "scenario": s.seed,
            "question": s.question,
            "answer": s.answer,
            "sources": " ".join(s.source_ids),
        },
    )
    turns = 0
    while turns < max_turns and not episode.done:
        choice = await _ask(model, traj.messages(), step, temperature, max_tokens, constrained)
        traj.messages_and_choices.append(choice)
        turns += 1
        calls = tool_calls_of(choice, turns)
        if not calls:
            traj.log(
                f"turn {turns}: no tool call, the episode ends: {(choice.message.content or '')[:200]!r}"
            )
            break
        for call in calls:
            result = episode.call(call.name, call.arguments)
            traj.messages_and_choices.append({"role": "tool", "tool_call_id": call.id, "content": result})
            traj.log(f"turn {turns}: {call.name}({call.arguments}) -> {result[:120]!r}")
            if episode.done:
                break
    score = score_episode(episode, turns)
    traj.reward = score.reward
    traj.metrics.update(
        {
            "correct": score.answer_score == 1.0,
            "answer_score": score.answer_score,
            "sources_ok": score.sources_ok,
            "answered": episode.done,
            "turns": turns,
            "tool_errors": episode.tool_errors,
            "read_source": bool(episode.read_ids & set(s.source_ids)),
        }
    )
    traj.log(f"answer {episode.answer!r} sources {episode.sources}; truth {s.answer!r} {list(s.source_ids)}")
    return traj.finish()
