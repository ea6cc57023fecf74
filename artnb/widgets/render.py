"""HTML for the panels: chat turns, tool calls, token colours, tables. Pure functions of core objects.

Kept apart from the widget classes so they are tested as strings and reused by any front end. Everything a
user wrote or a model generated is escaped. Long contents are shown in a scroll box and cut at
`MAX_CHARS` characters, so one runaway generation cannot make the page heavy, and long words wrap, so one
unbroken line cannot make it wide. Text and border colours are JupyterLab's theme variables with the light
colours as fallback (Colab and the classic Notebook have no variables), so dark themes stay readable; token
spans keep dark text because their background is always a light colour of ours.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Iterable
from typing import Any

from openai.types.chat.chat_completion import Choice

from ..core.tokens import TokenRow, summarize_tokens
from ..core.trajectory import Trajectory, choice_to_message

MAX_CHARS = 20_000
ROLE_COLORS = {"system": "#6c757d", "user": "#1f77b4", "assistant": "#2ca02c", "tool": "#9467bd"}
STYLE = """<style>
.artnb-block,.artnb-msg,.artnb-kv,.artnb-table{line-height:1.45}
.artnb-block,.artnb-kv,.artnb-table td{overflow-wrap:anywhere}
.artnb-msg{border-left:3px solid var(--jp-border-color1,#ccc);margin:4px 0;padding:2px 8px;font-size:13px;min-width:0}
.artnb-msg .artnb-role{font-weight:600;font-size:11px;letter-spacing:.04em}
.artnb-msg .artnb-role-name{text-transform:uppercase}
.artnb-msg .artnb-body{white-space:pre-wrap;overflow-wrap:anywhere;max-width:100%;
  max-height:16em;overflow:auto;font-family:var(--jp-code-font-family,monospace)}
.artnb-block pre,.artnb-kv pre{max-width:100%;overflow:auto}
.artnb-trainable{background:rgba(44,160,44,.07)}
.artnb-badge{font-size:10px;border-radius:3px;padding:0 4px;margin-left:6px;background:#2ca02c;color:#fff}
.artnb-tok{white-space:pre-wrap;border-radius:2px;padding:0 1px;margin-right:1px;box-shadow:inset 0 0 0 1px rgba(0,0,0,.12);
  font-family:var(--jp-code-font-family,monospace);font-size:13px;color:#222}
.artnb-table{border-collapse:collapse;font-size:12px}
.artnb-table td,.artnb-table th{border-bottom:1px solid var(--jp-border-color2,#ddd);padding:2px 8px;text-align:left;vertical-align:top}
.artnb-disagree,.artnb-fail{background:rgba(214,39,40,.12)}
.artnb-warn{background:rgba(230,149,0,.12)}
.artnb-kv{font-size:12px;color:var(--jp-content-font-color2,#444)}
</style>"""


def message_dict(item: Any) -> dict[str, Any]:
    """The message an item of `messages_and_choices` stands for, flagged `trainable` for a Choice."""
    if isinstance(item, Choice):
        return {**choice_to_message(item), "trainable": True}
    return item


def content_text(content: Any) -> str:
    """Message content as text: strings as is, content parts joined, images as a placeholder."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict) and p.get("type") == "text":
                parts.append(str(p.get("text", "")))
            elif isinstance(p, dict):
                parts.append(f"[{p.get('type', 'part')}]")
            else:
                parts.append(str(p))
        return "\n".join(parts)
    return str(content)


def _clip(text: str) -> str:
    if len(text) <= MAX_CHARS:
        return html.escape(text)
    return html.escape(text[:MAX_CHARS]) + f"\n<i>… {len(text) - MAX_CHARS:,} more characters not shown</i>"


def tool_call_html(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments", "")
    try:
        args = json.dumps(json.loads(args), indent=1, ensure_ascii=False)
    except (TypeError, ValueError):
        pass
    return f"🔧 <b>{html.escape(str(fn.get('name', '?')))}</b>({_clip(str(args))})"


def message_html(message: dict[str, Any], turn: int | None = None) -> str:
    """One chat turn; trainable turns are tinted and badged with their turn number."""
    role = str(message.get("role", "?"))
    color = ROLE_COLORS.get(role, "#999")
    trainable = bool(message.get("trainable"))
    badge = (
        f"<span class='artnb-badge'>trainable turn {turn}</span>" if trainable and turn is not None else ""
    )
    if role == "tool" and message.get("tool_call_id"):
        badge += f" <span class='artnb-kv'>result of {html.escape(str(message['tool_call_id']))}</span>"
    body = _clip(content_text(message.get("content")))
    calls = message.get("tool_calls") or []
    if calls:
        body += ("\n" if body else "") + "\n".join(tool_call_html(c) for c in calls)
    cls = "artnb-msg artnb-trainable" if trainable else "artnb-msg"
    return (
        f"<div class='{cls}' style='border-left-color:{color}'>"
        f"<div class='artnb-role' style='color:{color}'><span class='artnb-role-name'>{html.escape(role)}</span>"
        f"{badge}</div>"
        f"<div class='artnb-body'>{body}</div></div>"
    )


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list, tuple)):  # nested metadata: as JSON, not Python's repr
        return json.dumps(v, ensure_ascii=False, default=str)
    return str(v)


def kv_html(values: dict[str, Any]) -> str:
    return " · ".join(f"{html.escape(str(k))}={html.escape(_fmt(v))}" for k, v in values.items())


def trajectory_header_html(traj: Trajectory, index: int, rank: int) -> str:
    """Rank, reward, metrics, metadata and (folded) logs of one trajectory."""
    reward = f"<b>reward {traj.reward:.4g}</b>"
    if not math.isfinite(traj.reward):
        reward = f"<b class='artnb-fail'>reward {traj.reward} (not finite: training refuses its group)</b>"
    parts = [f"<b>#{rank}</b> trajectory {index} · {reward}"]
    if traj.metrics:
        parts.append(f"<div class='artnb-kv'>metrics: {kv_html(traj.metrics)}</div>")
    if traj.metadata:
        parts.append(f"<div class='artnb-kv'>metadata: {kv_html(traj.metadata)}</div>")
    if traj.logs:
        logs = "\n".join(traj.logs)
        parts.append(
            f"<details><summary class='artnb-kv'>logs ({len(traj.logs)})</summary>"
            f"<pre style='font-size:12px;white-space:pre-wrap'>{_clip(logs)}</pre></details>"
        )
    return f"<div class='artnb-block'>{''.join(parts)}</div>"


def prob_color(prob: float | None) -> str:
    """Background for a token: red at probability 0 through yellow to green at 1; grey when unknown."""
    if prob is None or not math.isfinite(prob):
        return "#e0e0e0"
    hue = round(120 * min(max(prob, 0.0), 1.0))
    return f"hsl({hue},75%,80%)"


def _token_text(token: str) -> str:
    return html.escape(token.replace("\n", "↵\n")) if token else "∅"


def tokens_html(rows: list[TokenRow]) -> str:
    """The turn's tokens coloured by sampling probability, with logprob and alternatives on hover."""
    if not rows:
        return (
            "<i>no sampling logprobs stored for this turn; artnb's engines return them by default, other "
            "endpoints need <code>logprobs=True</code> in the request</i>"
        )
    spans = []
    for r in rows:
        tip = "no logprob" if r.logprob is None else f"p={r.prob:.3f} logprob={r.logprob:.3f}"
        if r.top:
            tip += "; alternatives: " + ", ".join(f"{t!r} {lp:.2f}" for t, lp in r.top)
        spans.append(
            f"<span class='artnb-tok' style='background:{prob_color(r.prob)}' "
            f"title='{html.escape(tip, quote=True)}'>{_token_text(r.token)}</span>"
        )
    s = summarize_tokens(rows)
    summary = f"{s.num_tokens} tokens"
    if s.mean_logprob is not None:
        lows = ", ".join(f"{_token_text(r.token)!s} (p={r.prob:.2f})" for r in s.least_likely)
        summary += (
            f" · mean logprob {s.mean_logprob:.3f} · perplexity {s.perplexity:.3g} · least likely: {lows}"
        )
    legend = (
        "<span class='artnb-kv'>colour = sampling probability: "
        f"<span class='artnb-tok' style='background:{prob_color(0.0)}'>0</span> "
        f"<span class='artnb-tok' style='background:{prob_color(0.5)}'>0.5</span> "
        f"<span class='artnb-tok' style='background:{prob_color(1.0)}'>1</span></span>"
    )
    return (
        f"<div class='artnb-block'><div style='line-height:1.9'>{''.join(spans)}</div>"
        f"<div class='artnb-kv'>{summary}</div>{legend}</div>"
    )


def table_html(
    header: Iterable[str], rows: Iterable[Iterable[Any]], row_classes: Iterable[str] | None = None
) -> str:
    """A small HTML table; cells are escaped; `row_classes` tags rows (e.g. `artnb-disagree`)."""
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    classes = list(row_classes) if row_classes is not None else None
    body = []
    for i, row in enumerate(rows):
        cls = f" class='{classes[i]}'" if classes and classes[i] else ""
        body.append(f"<tr{cls}>" + "".join(f"<td>{_cell(v)}</td>" for v in row) + "</tr>")
    return f"<table class='artnb-table'><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _cell(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    text = _fmt(v)
    if len(text) > 160:
        return f"<details><summary>{html.escape(text[:160])}…</summary>{_clip(text)}</details>"
    return html.escape(text)
