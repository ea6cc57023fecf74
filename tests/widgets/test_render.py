"""The panels' HTML and CSS: what stays readable on a dark theme, in a narrow window, and as the model wrote it."""

import re

from artnb.widgets.render import STYLE, message_html


def rules(style: str) -> dict[str, str]:
    """Selector -> declarations of each rule in a <style> block."""
    return {sel.strip(): body for sel, body in re.findall(r"([^{}<>]+)\{([^}]*)\}", style)}


def test_text_and_border_colours_follow_the_jupyterlab_theme():
    fixed_background = {".artnb-badge", ".artnb-tok"}  # our own light or green background: fixed text colour
    for selector, body in rules(STYLE).items():
        for prop, value in re.findall(r"(?<![-\w])(color|border[-\w]*)\s*:\s*([^;]+)", body):
            if prop == "color" and selector in fixed_background:
                continue
            if "#" in value:  # a fixed colour is only the fallback of a theme variable (Colab has none)
                assert re.search(r"var\(--jp-[-\w]+,\s*#\w+\)", value), f"{selector} {prop}:{value}"


def test_a_long_unbroken_line_wraps_inside_its_card():
    body = rules(STYLE)[".artnb-msg .artnb-body"]
    assert "overflow-wrap:anywhere" in body and "white-space:pre-wrap" in body and "overflow:auto" in body


def test_tool_call_ids_keep_their_case():
    shown = message_html({"role": "tool", "tool_call_id": "call_AbC9", "content": "ok"})
    assert "<span class='artnb-role-name'>tool</span>" in shown and "result of call_AbC9" in shown
    uppercased = [sel for sel, body in rules(STYLE).items() if "text-transform:uppercase" in body]
    assert uppercased == [".artnb-msg .artnb-role-name"]  # the role word only, not ids or badges
