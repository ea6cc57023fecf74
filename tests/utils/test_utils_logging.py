"""The console helpers ART's MCP notebook imports: one line each, plain text where colour would not render."""

from artnb.utils.logging import err, info, ok, step, warn


def test_one_plain_line_per_call(capsys, monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    for say, text in ((info, "a"), (ok, "b"), (step, "c"), (warn, "d"), (err, "e")):
        say(text)
    assert capsys.readouterr().out.splitlines() == ["[i] a", "[ok] b", "==> c", "[!] d", "[x] e"]
