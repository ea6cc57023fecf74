"""Names that become folders or adapter keys: what passes, and what is refused with the rule."""

import numpy as np
import pytest

from artnb.core.names import check_adapter_name, check_name, check_split, check_step, from_art_step


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


@pytest.mark.parametrize("name", ["agent\n", "agent\r\n", "a\n"])
def test_a_trailing_newline_is_refused_in_every_kind_of_name(name):
    with pytest.raises(ValueError, match="is not allowed"):
        check_name(name)
    with pytest.raises(ValueError, match="is not allowed"):
        check_adapter_name(name)
    with pytest.raises(ValueError, match="is not allowed"):
        check_adapter_name(f"agent@3{name[-1]}")
    assert from_art_step("agent:step3\n") == "agent:step3\n"


def test_splits_follow_the_name_rule_and_say_what_to_pass():
    assert check_split("val") == "val" and check_split("train") == "train"
    with pytest.raises(ValueError, match=r"split='\.\./x' is not allowed.*For example 'x'"):
        check_split("../x")
    with pytest.raises(ValueError, match=r"split='' is not allowed.*For example 'val'"):
        check_split("")
    with pytest.raises(
        TypeError, match=r"split must be a string .*\(got NoneType None\); pass e\.g\. split='val'"
    ):
        check_split(None)


def test_steps_are_whole_numbers_from_zero():
    assert check_step(0) == 0 and check_step(np.int64(4)) == 4 and type(check_step(np.int64(4))) is int
    for bad in ("3", 1.5, True, None):
        with pytest.raises(TypeError, match=r"step must be a whole number >= 0 \(got .*\); pass an int"):
            check_step(bad)
    with pytest.raises(ValueError, match=r"step must be >= 0 \(got -1\)"):
        check_step(-1)
