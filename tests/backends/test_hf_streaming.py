"""What a stream may send before a row ends: only text no later token can change."""

from __future__ import annotations

from artnb.backends.engines.hf.streaming import TOOL_CALL_START, held_back


def test_text_is_sent_up_to_a_possible_stop_string():
    assert held_back("Hello wor", stops=["world"], hold=[]) == "Hello "
    assert held_back("Hello", stops=["world"], hold=[]) == "Hello"
    assert held_back("Hello w", stops=["xyz", "wo"], hold=[]) == "Hello "


def test_a_split_character_waits_for_its_other_bytes():
    assert held_back("caf\ufffd", stops=[], hold=[]) == "caf"


def test_with_tools_nothing_from_a_tool_call_on_is_sent():
    assert held_back('Let me check. <tool_call>{"na', stops=[], hold=[TOOL_CALL_START]) == "Let me check. "
    assert held_back("Let me check. <tool", stops=[], hold=[TOOL_CALL_START]) == "Let me check. "
    assert held_back("a < b", stops=[], hold=[TOOL_CALL_START]) == "a < b"
    assert held_back("a <", stops=[], hold=[TOOL_CALL_START]) == "a "
