"""PreflightView: a preflight report as a panel, so the verdict is the first thing a notebook shows.

The checks are measured and judged in `core.preflight`; this view only lays them out: the verdict in a coloured
line, then one row per check (status, what was found, what to change). It keeps the report, so its state is
tested without a browser.
"""

from __future__ import annotations

import html

import ipywidgets as widgets

from ..core.preflight import PreflightReport
from .render import STYLE, table_html

COLORS = {"ok": "#2ca02c", "warn": "#e69500", "fail": "#d62728"}


class PreflightView(widgets.VBox):
    """`art.widgets.PreflightView(await art.preflight(model, rollout, scenarios))`: the verdict and each check."""

    def __init__(self, report: PreflightReport) -> None:
        self.report = report
        self.verdict = widgets.HTML(verdict_html(report))
        self.checks = widgets.HTML(checks_html(report))
        super().__init__([self.verdict, self.checks])
        self.add_class("artnb-preflight")


def verdict_html(report: PreflightReport) -> str:
    status = "fail" if not report.ok else ("warn" if any(c.status == "warn" for c in report.checks) else "ok")
    return (
        f"<div style='border-left:4px solid {COLORS[status]};padding:4px 10px;font-weight:600'>"
        f"preflight: {html.escape(report.verdict)}</div>"
    )


def checks_html(report: PreflightReport) -> str:
    rows = [(c.status, c.name, c.finding, c.advice) for c in report.checks]
    classes = [f"artnb-{c.status}" for c in report.checks]
    return STYLE + table_html(("status", "check", "finding", "what to change"), rows, classes)
