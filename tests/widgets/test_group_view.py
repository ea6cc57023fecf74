"""GroupView state without a browser: order, pages, chat contents, token colours, lazy long chats."""

import math

from openai.types.chat.chat_completion import Choice

import artnb as art
from artnb.core.store import RunStore
from artnb.widgets import GroupView
from artnb.widgets.render import prob_color


def choice(text: str, logprobs: list[float]) -> Choice:
    tokens = list(text) if len(text) == len(logprobs) else [text] * len(logprobs)
    return Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": text},
            "logprobs": {
                "content": [
                    {
                        "token": t,
                        "logprob": lp,
                        "bytes": None,
                        "top_logprobs": [{"token": "z", "logprob": -3.0}],
                    }
                    for t, lp in zip(tokens, logprobs, strict=True)
                ]
            },
        }
    )


def game(reward: float, turns: int = 2) -> art.Trajectory:
    items: list = [{"role": "system", "content": "play"}]
    for k in range(turns):
        items += [{"role": "user", "content": f"board {k}"}, choice("B2", [-0.1, -2.0])]
    return art.Trajectory(messages_and_choices=items, reward=reward, metrics={"win": reward > 0.5})


def card_html(card) -> str:
    return "".join(getattr(w, "value", "") for w in card.chat.children if hasattr(w, "value"))


def test_sorted_order_and_pages():
    rewards = [(i * 37) % 64 / 64 for i in range(64)]
    view = GroupView(art.TrajectoryGroup([game(r) for r in rewards]))
    by_reward = sorted(range(64), key=lambda i: rewards[i], reverse=True)
    assert view.order == by_reward
    assert view.num_pages == 8 and view.page_label.value == "page 1/8"
    assert [c.index for c in view.cards] == by_reward[:8]
    assert [c.rank for c in view.cards] == list(range(1, 9))
    assert view.prev_button.disabled and not view.next_button.disabled

    view.next_button.click()
    assert view.page == 1 and [c.index for c in view.cards] == by_reward[8:16]
    assert list(view.body.children) == view.cards

    view.sort.value = "reward ↑"
    assert view.page == 0 and [c.index for c in view.cards] == by_reward[::-1][:8]
    view.sort.value = "original"
    assert [c.index for c in view.cards] == list(range(8))

    view.arrangement.value = "side by side"
    assert view.page_size == 4 and len(view.cards) == 4
    assert view.body.layout.flex_flow == "row nowrap" and view.cards[0].layout.width == "360px"
    view.go_to(99)
    assert view.page == 15 and view.next_button.disabled


def test_chat_shows_roles_tool_calls_and_trainable_turns():
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    traj = art.Trajectory(
        messages_and_choices=[
            {"role": "system", "content": "be <b>brief</b>"},
            {"role": "user", "content": [{"type": "text", "text": "weather?"}, {"type": "image_url"}]},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            choice("sunny", [-0.5] * 5),
        ],
        reward=1.0,
        metadata={"city": "Oslo"},
        logs=["looked up Oslo"],
    )
    view = GroupView(art.TrajectoryGroup([traj, game(0.0)]))
    card = view.cards[0]
    html = card_html(card)
    assert "be &lt;b&gt;brief&lt;/b&gt;" in html  # escaped, never injected
    assert "weather?\n[image_url]" in html
    assert "🔧 <b>get_weather</b>" in html and "&quot;city&quot;: &quot;Oslo&quot;" in html
    assert "result of call_1" in html
    assert "trainable turn 1" in html and html.count("artnb-trainable") == 1
    assert (
        "reward 1" in card.header.value
        and "city=Oslo" in card.header.value
        and "looked up Oslo" in card.header.value
    )
    assert [b.description for b in card.token_buttons] == ["tokens of turn 1"]


def test_token_view_colours_by_sampling_probability():
    view = GroupView(art.TrajectoryGroup([game(1.0, turns=1), game(0.0, turns=1)]))
    card = view.cards[0]
    button, tokens = card.token_buttons[0], card.token_views[0]
    assert tokens.value == "" and tokens.layout.display == "none"  # rendered only on demand
    button.click()
    assert tokens.layout.display == "block"
    assert f"background:{prob_color(math.exp(-0.1))}'" in tokens.value
    assert f"background:{prob_color(math.exp(-2.0))}'" in tokens.value
    assert (
        prob_color(math.exp(-0.1)) == "hsl(109,75%,80%)" and prob_color(math.exp(-2.0)) == "hsl(16,75%,80%)"
    )
    assert "alternatives: &#x27;z&#x27; -3.00" in tokens.value
    assert "least likely: 2 (p=0.14)" in tokens.value
    button.click()
    assert tokens.layout.display == "none"


def test_long_chats_render_a_page_at_a_time():
    long_game = game(0.5, turns=250)  # 501 turns
    view = GroupView(art.TrajectoryGroup([long_game] * 64), max_messages=40)
    assert len(view.cards) == 8
    card = view.cards[0]
    assert card.num_messages == 501 and card.shown == 40
    assert card.more_button in card.chat.children
    assert card.more_button.description == "show 40 more of 461 turns"
    assert len(card.token_buttons) == 19  # system + 19 (user, move) pairs + 1 user
    card.more_button.click()
    assert card.shown == 80 and len(card.token_buttons) == 39
    assert "trainable turn 21" in card_html(card)


async def test_live_group_and_the_same_group_read_from_disk(played_group, tmp_path):
    view = GroupView(played_group)
    assert len(view.cards) == 4
    card = view.cards[0]
    assert card.token_buttons, "every tic-tac-toe game has at least one trainable move"
    card.token_buttons[0].click()
    first_move = next(x for x in card.trajectory.messages_and_choices if isinstance(x, Choice))
    assert (
        card.token_views[0].value.count("class='artnb-tok'") == len(first_move.logprobs.content) + 3
    )  # + legend

    store = RunStore(tmp_path, "p", "m")
    store.write_trajectories("train", 0, [played_group])
    (from_disk,) = store.read_trajectories("train", 0)
    disk_view = GroupView([from_disk, played_group])
    assert disk_view.group_select.layout.display is None and len(disk_view.group_select.options) == 2
    disk_card = disk_view.cards[0]
    assert len(disk_card.token_buttons) == len(card.token_buttons)  # same sort, same first game
    disk_card.token_buttons[0].click()
    assert "class='artnb-tok'" in disk_card.token_views[0].value
    disk_view.group_select.value = 1
    assert disk_view.group is played_group


def test_summary_flags_equal_rewards_and_failed_rollouts():
    group = art.TrajectoryGroup([game(0.5), game(0.5), ValueError("board parse failed")])
    view = GroupView(group)
    assert "all rewards equal" in view.summary.value
    assert "1 rollouts failed" in view.summary.value and "board parse failed" in view.summary.value
    view.set_groups([])
    assert view.cards == [] and "no trajectories yet" in view.summary.value


def test_nested_metadata_is_shown_as_json():
    from artnb.widgets.render import trajectory_header_html

    traj = art.Trajectory(metadata={"cfg": {"tags": ["a"], "on": True}})
    shown = trajectory_header_html(traj, 0, 1)
    assert "cfg={&quot;tags&quot;: [&quot;a&quot;], &quot;on&quot;: true}" in shown


def test_non_finite_rewards_are_shown_last_and_named_in_the_summary():
    view = GroupView(art.TrajectoryGroup([game(float("nan")), game(1.0), game(float("inf")), game(0.0)]))
    assert view.order == [1, 3, 0, 2]
    view.sort.value = "reward ↑"
    assert view.order == [3, 1, 0, 2]  # last either way: training refuses them, so they are not "best"
    summary = view.summary.value
    assert "reward mean 0.5, min 0, max 1, std 0.5" in summary  # over the finite rewards
    assert "non-finite reward in trajectory 0 (nan), 2 (inf)" in summary
    assert "training refuses this group (rewards must be finite numbers)" in summary
    nan_card = next(c for c in view.cards if c.index == 0)
    assert "reward nan (not finite" in nan_card.header.value
    assert view.group_select.options[0][0] == "group 0: 4 trajectories, mean reward 0.5"


def test_a_group_of_one_is_flagged_as_teaching_nothing():
    view = GroupView(art.TrajectoryGroup([game(1.0)]))
    assert "a group of one has zero advantage: GRPO learns nothing from it" in view.summary.value
