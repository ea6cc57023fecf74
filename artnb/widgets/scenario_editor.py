"""ScenarioEditor: look over generated scenarios before training on them; edit, delete or add rows.

Why it exists: generated inputs are the whole data set of an AutoRL run, and a generator (a 135M model most
of all) writes some that are off-task, repeated or empty. A minute of reading and fixing them is worth more
than any filter.

Why it is built this way:
- The state lives in `ScenarioDraft`, a plain class (a list of rows, each text and difficulty), tested
  without a browser; `ScenarioEditor` only lays out one Textarea, difficulty box and delete button per row,
  and writes every edit through to the draft.
- Rows may be invalid while being edited (an empty row just added); `scenarios` validates them all when read
  and raises one error naming every bad row and what to do, so nothing invalid reaches training.
"""

from __future__ import annotations

import html
from collections.abc import Iterable
from dataclasses import dataclass

import ipywidgets as widgets
from pydantic import ValidationError

from ..autorl import MAX_TASK_CHARS, MIN_TASK_CHARS, Scenario
from .render import STYLE


@dataclass
class DraftRow:
    task: str
    difficulty: int = 3


class ScenarioDraft:
    """Scenarios being edited: rows of (task text, difficulty), validated only when `scenarios` is read.

    >>> draft = ScenarioDraft(scenarios)
    >>> draft.edit(0, "My order arrived broken.")
    >>> draft.delete(2); draft.add("Why was I charged twice?", difficulty=2)
    >>> draft.scenarios        # list[Scenario]; ValueError naming the bad rows if any
    """

    def __init__(self, scenarios: Iterable[Scenario | str] = ()) -> None:
        self.rows: list[DraftRow] = []
        for s in scenarios:
            if isinstance(s, str):
                self.rows.append(DraftRow(s))
            elif isinstance(getattr(s, "task", None), str) and isinstance(
                getattr(s, "difficulty", None), int
            ):
                self.rows.append(
                    DraftRow(s.task, s.difficulty)
                )  # AutoRL's Scenario, art.mcp's GeneratedScenario
            else:
                raise TypeError(
                    f"scenarios are strings or objects with a task and a difficulty (AutoRL's or art.mcp's), "
                    f"got {type(s).__name__}"
                )

    def __len__(self) -> int:
        return len(self.rows)

    def _check(self, index: int) -> None:
        if not -len(self.rows) <= index < len(self.rows):
            raise IndexError(
                f"row {index} does not exist: there are {len(self.rows)} rows (0 to {len(self) - 1})"
            )

    def edit(self, index: int, task: str | None = None, difficulty: int | None = None) -> None:
        """Change a row's text and/or difficulty."""
        self._check(index)
        if task is not None:
            self.rows[index].task = task
        if difficulty is not None:
            self.rows[index].difficulty = difficulty

    def delete(self, index: int) -> None:
        self._check(index)
        del self.rows[index]

    def add(self, task: str = "", difficulty: int = 3) -> int:
        """Append a row (empty by default, to be filled in); returns its index."""
        self.rows.append(DraftRow(task, difficulty))
        return len(self.rows) - 1

    def errors(self) -> dict[int, str]:
        """Row index -> what is wrong with it, for every row that would not validate."""
        found = {}
        for i, row in enumerate(self.rows):
            try:
                Scenario(task=row.task, difficulty=row.difficulty)
            except ValidationError as error:
                found[i] = _problem(error, row)
        return found

    @property
    def scenarios(self) -> list[Scenario]:
        """The rows as validated Scenarios; a ValueError lists every invalid row."""
        bad = self.errors()
        if bad:
            listed = "; ".join(f"row {i}: {why}" for i, why in bad.items())
            raise ValueError(f"{len(bad)} scenario{'s are' if len(bad) > 1 else ' is'} invalid ({listed})")
        if not self.rows:
            raise ValueError("no scenarios left: add at least one row (or generate more)")
        return [Scenario(task=r.task, difficulty=r.difficulty) for r in self.rows]


def _problem(error: ValidationError, row: DraftRow) -> str:
    field = str(error.errors()[0]["loc"][0])
    if field == "task":
        n = len(row.task.strip())
        if n == 0:
            return "the text is empty: write the user's message, or delete the row"
        if n < MIN_TASK_CHARS:
            return f"the text has {n} characters: write at least {MIN_TASK_CHARS}"
        return f"the text has {n} characters: shorten it to at most {MAX_TASK_CHARS}"
    return f"difficulty {row.difficulty!r} is not allowed: choose a whole number from 1 to 5"


class ScenarioEditor(widgets.VBox):
    """Generated scenarios as editable rows: text, difficulty (1-5), delete button; an "add" button below.

    >>> editor = art.widgets.ScenarioEditor(scenarios); editor      # edit in the notebook, then:
    >>> scenarios = editor.scenarios                                # validated list[Scenario]
    """

    def __init__(self, scenarios: Iterable[Scenario | str] = ()) -> None:
        self.draft = ScenarioDraft(scenarios)
        self.rows_box = widgets.VBox()
        self.add_button = widgets.Button(description="add", icon="plus", tooltip="add an empty scenario")
        self.status = widgets.HTML()
        self.add_button.on_click(lambda _: self.add())
        super().__init__([widgets.HTML(STYLE), self.rows_box, widgets.HBox([self.add_button, self.status])])
        self.add_class("artnb-scenario-editor")
        self._render()

    @property
    def scenarios(self) -> list[Scenario]:
        return self.draft.scenarios

    @property
    def row_widgets(self) -> list[tuple[widgets.Textarea, widgets.BoundedIntText, widgets.Button]]:
        return [(row.children[0], row.children[1], row.children[2]) for row in self.rows_box.children]

    def add(self, task: str = "", difficulty: int = 3) -> None:
        self.draft.add(task, difficulty)
        self._render()

    def delete(self, index: int) -> None:
        self.draft.delete(index)
        self._render()

    def _render(self) -> None:
        self.rows_box.children = [self._row(i, row) for i, row in enumerate(self.draft.rows)]
        self._update_status()

    def _row(self, index: int, row: DraftRow) -> widgets.HBox:
        text = widgets.Textarea(
            value=row.task,
            placeholder="the user's message",
            layout=widgets.Layout(width="100%", height="3.2em"),
        )
        difficulty = widgets.BoundedIntText(
            value=min(max(row.difficulty, 1), 5),
            min=1,
            max=5,
            description="difficulty",
            layout={"width": "150px"},
        )
        delete = widgets.Button(icon="trash", tooltip="delete this scenario", layout={"width": "40px"})
        text.observe(lambda change: self._edited(index, task=change["new"]), names="value")
        difficulty.observe(lambda change: self._edited(index, difficulty=change["new"]), names="value")
        delete.on_click(lambda _: self.delete(index))
        box = widgets.HBox([text, difficulty, delete])
        box.add_class("artnb-scenario-row")
        return box

    def _edited(self, index: int, task: str | None = None, difficulty: int | None = None) -> None:
        self.draft.edit(index, task, difficulty)
        self._update_status()

    def _update_status(self) -> None:
        bad = self.draft.errors()
        for i, row in enumerate(self.rows_box.children):
            (row.add_class if i in bad else row.remove_class)("artnb-invalid")
        text = f"{len(self.draft)} scenarios"
        if bad:
            text += " · " + "; ".join(f"row {i}: {html.escape(why)}" for i, why in bad.items())
        self.status.value = f"<span class='artnb-kv'>{text}</span>"
