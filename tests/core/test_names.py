"""Names that become folders or adapter keys: what passes, and what is refused with the rule."""

import pytest

from artnb.core.names import check_adapter_name, check_name, from_art_step


@pytest.mark.parametrize("name", ["agent", "agent@3", "agent-001@12", "my agent.v2@0", "_x"])
def test_adapter_names_artnb_serves_pass(name):
    assert check_adapter_name(name) == name


@pytest.mark.parametrize("name", ["../x", "a/b", "..", "x@", "x@-1", "x@3@4", "@3", "a\\b", "", "x.@2", 7])
def test_path_like_or_malformed_adapter_names_are_refused_with_the_rule(name):
    with pytest.raises(ValueError, match="adapter name .* is not allowed: .*e.g. 'agent@3'"):
        check_adapter_name(name)


def test_run_names_refuse_what_would_leave_the_run_directory():
    with pytest.raises(ValueError, match=r"name='\.\./x' is not allowed.*For example 'x'"):
        check_name("../x")
    assert check_name("agent-001") == "agent-001"


def test_arts_serverless_step_spelling_names_the_same_adapter():
    assert (
        from_art_step("agent:step3") == "agent@3" and from_art_step("my agent.v2:step012") == "my agent.v2@12"
    )
    for unchanged in ("agent", "agent@3", "agent:stepx", "agent:step", ":step3x"):
        assert from_art_step(unchanged) == unchanged
