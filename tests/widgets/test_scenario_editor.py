"""ScenarioEditor: the draft's logic and the widget's synced state, without a browser."""

from __future__ import annotations

import pytest

import artnb as art
from artnb.autorl import Scenario
from artnb.widgets.scenario_editor import ScenarioDraft

GENERATED = [
    Scenario(task="My order arrived two weeks late.", difficulty=2),
    Scenario(task="You charged my card twice for one sofa.", difficulty=4),
    Scenario(task="big_cow-cow-lamb nonsense", difficulty=3),
]


def test_draft_edit_delete_add_and_validate():
    draft = ScenarioDraft([*GENERATED, "The app logs me out every hour."])
    draft.edit(0, "My order arrived three weeks late.", difficulty=1)
    draft.delete(2)
    assert draft.add() == 3
    assert draft.errors() == {3: "the text is empty: write the user's message, or delete the row"}
    with pytest.raises(ValueError, match=r"1 scenario is invalid \(row 3: the text is empty"):
        _ = draft.scenarios
    draft.edit(3, "Why is there no refund yet?")
    draft.edit(1, difficulty=9)
    draft.add("short")
    assert draft.errors() == {
        1: "difficulty 9 is not allowed: choose a whole number from 1 to 5",
        4: "the text has 5 characters: write at least 8",
    }
    draft.delete(4)
    draft.edit(1, difficulty=5)
    assert [(s.task, s.difficulty) for s in draft.scenarios] == [
        ("My order arrived three weeks late.", 1),
        ("You charged my card twice for one sofa.", 5),
        ("The app logs me out every hour.", 3),
        ("Why is there no refund yet?", 3),
    ]


def test_draft_errors_name_the_problem():
    draft = ScenarioDraft(GENERATED)
    with pytest.raises(IndexError, match="row 7 does not exist: there are 3 rows"):
        draft.delete(7)
    draft.add("x" * 500)
    assert draft.errors() == {3: "the text has 500 characters: shorten it to at most 400"}
    for _ in range(4):
        draft.delete(0)
    with pytest.raises(ValueError, match="no scenarios left"):
        _ = draft.scenarios
    with pytest.raises(TypeError, match="strings or objects with a task and a difficulty"):
        ScenarioDraft([42])
    from artnb.mcp import GeneratedScenario  # MCP·RL's scenarios are edited the same way

    assert (
        ScenarioDraft([GeneratedScenario(task="List my notes.", difficulty=2)]).scenarios[0].difficulty == 2
    )


def test_editor_widgets_write_through_to_the_draft():
    editor = art.widgets.ScenarioEditor(GENERATED)
    assert "artnb-scenario-editor" in editor._dom_classes
    rows = editor.row_widgets
    assert [text.value for text, _, _ in rows] == [s.task for s in GENERATED]
    assert [d.value for _, d, _ in rows] == [2, 4, 3]

    rows[0][0].value = "My order arrived a month late."  # typing in the first Textarea
    rows[1][1].value = 5
    rows[2][2].click()  # delete the nonsense row
    assert len(editor.row_widgets) == 2

    editor.add_button.click()
    assert len(editor.row_widgets) == 3 and editor.row_widgets[2][0].value == ""
    assert "row 2: the text is empty" in editor.status.value
    assert "artnb-invalid" in editor.rows_box.children[2]._dom_classes
    with pytest.raises(ValueError, match="row 2: the text is empty"):
        _ = editor.scenarios

    editor.row_widgets[2][0].value = "Where is my refund?"
    assert "artnb-invalid" not in editor.rows_box.children[2]._dom_classes
    assert editor.status.value == "<span class='artnb-kv'>3 scenarios</span>"
    assert editor.scenarios == [
        Scenario(task="My order arrived a month late.", difficulty=2),
        Scenario(task="You charged my card twice for one sofa.", difficulty=5),
        Scenario(task="Where is my refund?", difficulty=3),
    ]
