"""GroupView: the trajectories of a group as chats, sorted by reward, with a token view per trainable turn.

Why it is built this way:
- Only one page of trajectories exists as widgets at a time (8 in a list, 4 side by side), and each chat
  shows its first `max_messages` turns with a button for more, so a group of 64 long games costs no more to
  show than a group of 4.
- A trainable turn's tokens are rendered only when its button is clicked: the token view is the expensive
  part (one span per token) and most turns are never opened.
- Context turns between two trainable turns are merged into one HTML widget to keep the widget count low.
Works on live groups (`Choice` turns) and on groups read back from disk (`model.store.read_trajectories`).
"""

from __future__ import annotations

import html
import math
import statistics
from collections.abc import Sequence
from typing import Literal, cast

import ipywidgets as widgets

from ..core.tokens import is_trainable_turn, token_rows
from ..core.trajectory import MessageOrChoice, Trajectory, TrajectoryGroup
from .render import STYLE, message_dict, message_html, tokens_html, trajectory_header_html

SortOrder = Literal["reward ↓", "reward ↑", "original"]
Arrangement = Literal["list", "side by side"]
PAGE_SIZE: dict[str, int] = {"list": 8, "side by side": 4}


class TrajectoryCard(widgets.VBox):
    """One trajectory: header (rank, reward, metrics, metadata, logs) and its chat with token buttons."""

    def __init__(self, traj: Trajectory, index: int, rank: int, *, max_messages: int = 40) -> None:
        self.trajectory = traj
        self.index = index
        self.rank = rank
        self.max_messages = max_messages
        # (history number, item) for the main chat and any additional histories, flattened.
        self._items = [
            (h, item) for h, hist in enumerate(traj.histories()) for item in hist.messages_and_choices
        ]
        self.shown = 0
        self.token_buttons: list[widgets.Button] = []
        self.token_views: list[widgets.HTML] = []
        self.header = widgets.HTML(trajectory_header_html(traj, index, rank))
        self.chat = widgets.VBox()
        self.more_button = widgets.Button(layout=widgets.Layout(width="auto", align_self="flex-start"))
        self.more_button.on_click(lambda _: self.show_more())
        self._turn = 0
        self._history = 0
        super().__init__(
            [self.header, self.chat],
            layout=widgets.Layout(
                border="1px solid var(--jp-border-color2, #ddd)", padding="4px 8px", margin="4px"
            ),
        )
        self.add_class("artnb-traj")
        self.show_more()

    @property
    def num_messages(self) -> int:
        return len(self._items)

    def show_more(self) -> None:
        """Render the next `max_messages` turns."""
        start, stop = self.shown, min(self.shown + self.max_messages, len(self._items))
        new: list[widgets.Widget] = []
        pending: list[str] = []

        def flush() -> None:
            if pending:
                new.append(widgets.HTML("".join(pending)))
                pending.clear()

        for h, item in self._items[start:stop]:
            if h != self._history:
                self._history = h
                pending.append(f"<div class='artnb-kv'><b>additional history {h}</b></div>")
            if is_trainable_turn(item):
                self._turn += 1
                pending.append(message_html(message_dict(item), turn=self._turn))
                flush()
                new.append(self._token_toggle(item, self._turn))
            else:
                pending.append(message_html(message_dict(item)))
        flush()
        self.shown = stop
        children = [c for c in self.chat.children if c is not self.more_button] + new
        left = len(self._items) - self.shown
        if left:
            self.more_button.description = f"show {min(left, self.max_messages)} more of {left} turns"
            children.append(self.more_button)
        self.chat.children = children

    def _token_toggle(self, item: MessageOrChoice, turn: int) -> widgets.Widget:
        button = widgets.Button(
            description=f"tokens of turn {turn}",
            icon="eye",
            tooltip="show this turn's tokens coloured by sampling probability",
            layout=widgets.Layout(width="auto", align_self="flex-start"),
        )
        view = widgets.HTML(layout=widgets.Layout(display="none"))

        def toggle(_: widgets.Button) -> None:
            if not view.value:
                view.value = tokens_html(token_rows(item))
            opening = view.layout.display == "none"
            view.layout.display = "block" if opening else "none"
            button.icon = "eye-slash" if opening else "eye"

        button.on_click(toggle)
        self.token_buttons.append(button)
        self.token_views.append(view)
        return widgets.VBox([button, view])


class GroupView(widgets.VBox):
    """Trajectories of one or more groups, sorted by reward, a page at a time.

    Example:
        groups = await art.gather_trajectory_groups(...)
        art.widgets.GroupView(groups)        # a list of groups: pick one in the dropdown
        art.widgets.GroupView(groups[0], arrangement="side by side")
    """

    def __init__(
        self,
        groups: TrajectoryGroup | Sequence[TrajectoryGroup] = (),
        *,
        sort: SortOrder = "reward ↓",
        arrangement: Arrangement = "list",
        page_size: int | None = None,
        max_messages: int = 40,
    ) -> None:
        if arrangement not in PAGE_SIZE:
            raise ValueError(f"arrangement={arrangement!r}: choose 'list' or 'side by side'")
        self.max_messages = max_messages
        self._page_size = page_size
        self.groups: list[TrajectoryGroup] = []
        self.page = 0
        self.cards: list[TrajectoryCard] = []
        self._quiet = False
        self.group_select = widgets.Dropdown(description="group", layout=widgets.Layout(width="auto"))
        self.sort = widgets.Dropdown(
            options=["reward ↓", "reward ↑", "original"], value=sort, description="sort"
        )
        self.arrangement = widgets.ToggleButtons(options=list(PAGE_SIZE), value=arrangement)
        self.prev_button = widgets.Button(
            icon="chevron-left", tooltip="previous page", layout={"width": "36px"}
        )
        self.next_button = widgets.Button(icon="chevron-right", tooltip="next page", layout={"width": "36px"})
        self.page_label = widgets.Label()
        self.summary = widgets.HTML()
        self.body = widgets.Box(layout=widgets.Layout(display="flex", flex_flow="column"))
        self.prev_button.on_click(lambda _: self.go_to(self.page - 1))
        self.next_button.on_click(lambda _: self.go_to(self.page + 1))
        for w in (self.group_select, self.sort, self.arrangement):
            w.observe(self._reset, names="value")
        bar = widgets.HBox(
            [
                self.group_select,
                self.sort,
                self.arrangement,
                self.prev_button,
                self.page_label,
                self.next_button,
            ],
            layout=widgets.Layout(flex_flow="row wrap", align_items="center"),
        )
        super().__init__([widgets.HTML(STYLE), bar, self.summary, self.body])
        self.add_class("artnb-group-view")
        self.set_groups(groups)

    # state -------------------------------------------------------------------------------------------
    @property
    def group(self) -> TrajectoryGroup | None:
        return (
            self.groups[self.group_select.value]
            if self.groups and self.group_select.value is not None
            else None
        )

    @property
    def page_size(self) -> int:
        # ipywidgets types a ToggleButtons' value as Any | None; this one always holds one of its options
        return self._page_size or PAGE_SIZE[cast(str, self.arrangement.value)]

    @property
    def order(self) -> list[int]:
        """Indices of the selected group's trajectories in display order."""
        group = self.group
        if group is None:
            return []
        idx = list(range(len(group)))
        if self.sort.value == "original":
            return idx
        sign = -1 if self.sort.value == "reward ↓" else 1

        def key(i: int) -> tuple[bool, float]:
            # non-finite rewards last either way: NaN has no order, and training refuses them anyway
            reward = group[i].reward
            return (False, sign * reward) if _finite(reward) else (True, 0.0)

        return sorted(idx, key=key)

    @property
    def num_pages(self) -> int:
        return max(1, -(-len(self.order) // self.page_size))

    @property
    def page_indices(self) -> list[int]:
        return self.order[self.page * self.page_size : (self.page + 1) * self.page_size]

    # actions -----------------------------------------------------------------------------------------
    def set_groups(self, groups: TrajectoryGroup | Sequence[TrajectoryGroup]) -> None:
        """Show other groups (e.g. the next step's); keeps the sort order and arrangement."""
        groups = [groups] if isinstance(groups, TrajectoryGroup) else list(groups)
        bad = [type(g).__name__ for g in groups if not isinstance(g, TrajectoryGroup)]
        if bad:
            raise TypeError(
                f"GroupView takes art.TrajectoryGroup objects, got {bad[0]}; await the gather first"
            )
        self.groups = groups
        options = [(_group_label(i, g), i) for i, g in enumerate(groups)]
        self._quiet = True
        try:
            self.group_select.options = options
            self.group_select.value = 0 if options else None
        finally:
            self._quiet = False
        self.group_select.layout.display = None if len(groups) > 1 else "none"
        self._reset()

    def go_to(self, page: int) -> None:
        self.page = min(max(page, 0), self.num_pages - 1)
        self._render()

    def _reset(self, _: object = None) -> None:
        if self._quiet:
            return
        self.page = 0
        self._render()

    def _render(self) -> None:
        group = self.group
        rank = {i: r + 1 for r, i in enumerate(self.order)}
        for old in self.cards:
            close_tree(old)
        self.cards = (
            [TrajectoryCard(group[i], i, rank[i], max_messages=self.max_messages) for i in self.page_indices]
            if group is not None
            else []
        )
        side = self.arrangement.value == "side by side"
        for c in self.cards:
            c.layout.width = "360px" if side else "auto"
            c.layout.flex = "0 0 auto" if side else None
        self.body.children = self.cards
        self.body.layout.flex_flow = "row nowrap" if side else "column"
        self.body.layout.overflow_x = "auto" if side else None
        self.page_label.value = f"page {self.page + 1}/{self.num_pages}"
        self.prev_button.disabled = self.page == 0
        self.next_button.disabled = self.page >= self.num_pages - 1
        self.summary.value = _summary_html(group)


def close_tree(widget: widgets.Widget) -> None:
    """Close a widget and everything inside it, so replaced pages do not pile up in the kernel."""
    for child in getattr(widget, "children", ()):
        close_tree(child)
    widget.close()


def _finite(reward: float) -> bool:
    return math.isfinite(reward)


def _group_label(i: int, g: TrajectoryGroup) -> str:
    finite = [r for r in g.rewards() if _finite(r)]
    mean = f"{statistics.fmean(finite):.3g}" if finite else "—"
    return f"group {i}: {len(g)} trajectories, mean reward {mean}"


def _summary_html(group: TrajectoryGroup | None) -> str:
    if group is None:
        return "<i>no trajectories yet</i>"
    rewards = group.rewards()
    finite = [r for r in rewards if _finite(r)]
    text = f"{len(group)} trajectories"
    if finite:
        text += f" · reward mean {statistics.fmean(finite):.4g}, min {min(finite):.4g}, max {max(finite):.4g}"
        if len(finite) > 1:
            text += f", std {statistics.pstdev(finite):.4g}"
    if len(rewards) != len(finite):
        bad = ", ".join(f"{i} ({r})" for i, r in enumerate(rewards) if not _finite(r))
        text += (
            f" · <b>non-finite reward in trajectory {bad}: training refuses this group "
            "(rewards must be finite numbers)</b>"
        )
    elif len(rewards) == 1:
        text += " · <b>a group of one has zero advantage: GRPO learns nothing from it</b>"
    elif len(rewards) > 1 and statistics.pstdev(rewards) == 0:
        text += " · <b>all rewards equal: GRPO learns nothing from this group</b>"
    if group.exceptions:
        errors = "".join(
            f"<details><summary>{html.escape(e.type)}: {html.escape(e.message[:200])}</summary>"
            f"<pre style='font-size:11px'>{html.escape(e.traceback)}</pre></details>"
            for e in group.exceptions
        )
        text += f" · <b>{len(group.exceptions)} rollouts failed</b>{errors}"
    return f"<div class='artnb-kv'>{text}</div>"
