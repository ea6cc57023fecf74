"""Tokenising trajectories: exact sampled ids at the mask, template rendering, EOS handling, errors and metrics.

Sampled ids are chosen so that re-tokenising their text gives different ids ("hel" + "lo" rather than "hello"):
finding them verbatim at the mask positions proves that generated text is never re-tokenised.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
from openai.types.chat.chat_completion import Choice
from transformers import AutoTokenizer

import artnb.models
from artnb.backends.model_setup import model_tokenizer
from artnb.core.chat_messages import template_message
from artnb.core.grpo import group_advantages
from artnb.core.sft import TrainSFTConfig, tokenize_sft
from artnb.core.tokenize import TokenizedSequence, tokenize_groups, tokenize_trajectory
from artnb.core.trajectory import History, Trajectory, TrajectoryGroup
from artnb.dev.settings import resolve_internal_config

TOOLS = [
    {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
]
# ChatML that also renders tools and tool calls (SmolLM2's own template ignores both).
TOOL_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + (m['content'] or '') }}"
    "{% for tc in m.get('tool_calls') or [] %}{{ '<tool_call>' + (tc['function'] | tojson) + '</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}{% endfor %}"
)


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(artnb.models.tiny())


@pytest.fixture(scope="module")
def tool_tok(tok):
    t = copy.deepcopy(tok)
    t.chat_template = TOOL_TEMPLATE
    return t


def split_ids(tok, *pieces: str) -> list[int]:
    """Ids of each piece encoded on its own: 'hel', 'lo' -> two ids where 'hello' would be one."""
    return [i for p in pieces for i in tok.encode(p, add_special_tokens=False)]


def make_choice(tok, ids, *, logprobs=True, finish="stop", fmt="ids", tool_calls=None) -> Choice:
    """A Choice as an engine returns it: per-token logprobs and, with fmt='ids', the extra token_ids field.

    fmt says how the logprob tokens are written: 'ids'/'text' decoded text, 'token_id' as "token_id:N",
    'vocab' as vocabulary strings; only 'ids' carries token_ids.
    """
    eos = tok.eos_token_id
    text = tok.decode([i for i in ids if i != eos])
    message: dict = {"role": "assistant", "content": None if tool_calls else text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    data: dict = {"index": 0, "finish_reason": finish, "message": message, "logprobs": None}
    if logprobs:
        text_of = {
            "ids": lambda i: tok.decode([i]),  # engines return the decoded text of each token
            "text": lambda i: tok.decode([i]),
            "token_id": lambda i: f"token_id:{i}",  # vLLM return_tokens_as_token_ids
            "vocab": tok.convert_ids_to_tokens,  # vocabulary strings ('Ġworld')
        }[fmt]
        data["logprobs"] = {
            "content": [
                {"token": text_of(i), "logprob": lp, "bytes": None, "top_logprobs": []}
                for i, lp in zip(ids, given_logprobs(ids), strict=True)
            ]
        }
    if fmt == "ids":
        data["token_ids"] = list(ids)
    return Choice.model_validate(data)


def given_logprobs(ids) -> list[float]:
    return [-0.1 * (n + 1) for n in range(len(ids))]


def trained(seq: TokenizedSequence) -> list[int]:
    return [t for t, m in zip(seq.token_ids, seq.assistant_mask, strict=True) if m]


def spans(seq: TokenizedSequence) -> list[list[int]]:
    """The runs of consecutive trainable token ids."""
    out: list[list[int]] = []
    prev = False
    for t, m in zip(seq.token_ids, seq.assistant_mask, strict=True):
        if m:
            if not prev:
                out.append([])
            out[-1].append(t)
        prev = m
    return out


def rendered(tok, traj: Trajectory, upto: int, tools=None) -> str:
    return tok.apply_chat_template(traj.messages()[:upto], tools=tools, tokenize=False)


def check_shape(seq: TokenizedSequence) -> None:
    assert len(seq.token_ids) == len(seq.assistant_mask) == len(seq.logprobs)
    assert all(math.isnan(lp) for lp, m in zip(seq.logprobs, seq.assistant_mask, strict=True) if not m)


def test_single_turn_keeps_sampled_ids_and_logprobs(tok):
    ids = split_ids(tok, "hel", "lo", " world", "<|im_end|>")
    assert tok.encode("hello world", add_special_tokens=False) != ids[:-1]  # would not round-trip
    choice = make_choice(tok, ids)
    traj = Trajectory(
        messages_and_choices=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            choice,
            {"role": "user", "content": "after the last trainable turn: cut"},
        ]
    )
    (seq,) = tokenize_trajectory(tok, traj, 0.5, group_index=3, trajectory_index=2)
    check_shape(seq)
    assert (seq.advantage, seq.group_index, seq.trajectory_index) == (0.5, 3, 2)
    assert tok.decode(seq.token_ids) == rendered(tok, traj, 3)
    assert trained(seq) == ids
    assert spans(seq) == [ids]
    assert [lp for lp, m in zip(seq.logprobs, seq.assistant_mask, strict=True) if m] == given_logprobs(ids)


def test_sampled_eos_is_trained_once_and_template_copy_dropped(tok):
    ids = split_ids(tok, "O", "k", "<|im_end|>")
    traj = Trajectory(messages_and_choices=[{"role": "user", "content": "Hi"}, make_choice(tok, ids)])
    (seq,) = tokenize_trajectory(tok, traj, 1.0)
    eos = tok.eos_token_id
    assert seq.token_ids.count(eos) == tok.encode(rendered(tok, traj, 2), add_special_tokens=False).count(eos)
    end = seq.assistant_mask.index(True) + len(ids)
    assert seq.token_ids[end - 1] == eos and seq.assistant_mask[end - 1]
    assert seq.token_ids[end:] == tok.encode("\n", add_special_tokens=False)  # template's "\n" after the EOS
    assert seq.assistant_mask[end:] == [False]


def test_length_stopped_turn_keeps_template_end_of_turn_as_context(tok):
    ids = split_ids(tok, "hel", "lo")
    traj = Trajectory(
        messages_and_choices=[{"role": "user", "content": "Hi"}, make_choice(tok, ids, finish="length")]
    )
    (seq,) = tokenize_trajectory(tok, traj, 1.0)
    assert tok.decode(seq.token_ids) == rendered(tok, traj, 2)
    end = seq.assistant_mask.index(True) + len(ids)
    assert trained(seq) == ids
    assert seq.token_ids[end] == tok.eos_token_id and not seq.assistant_mask[end]
    assert math.isnan(seq.logprobs[end])


@pytest.mark.filterwarnings("ignore:.*chat template does not render")  # tested below
def test_multi_turn_with_user_and_tool_messages_between(tok):
    first = split_ids(tok, "Let", " me", " lo", "ok", "<|im_end|>")
    second = split_ids(tok, "It", " is", " 4", "2", "<|im_end|>")
    traj = Trajectory(
        messages_and_choices=[
            {"role": "user", "content": "What is it?"},
            make_choice(tok, first),
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
            {"role": "user", "content": "So?"},
            make_choice(tok, second),
            {"role": "user", "content": "thanks"},
        ],
        tools=TOOLS,
    )
    (seq,) = tokenize_trajectory(tok, traj, -1.0)
    check_shape(seq)
    assert spans(seq) == [first, second]
    assert tok.decode(seq.token_ids) == rendered(tok, traj, 5, TOOLS)


def test_tool_call_choice_is_not_rendered_twice(tool_tok):
    call_text = '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'
    ids = split_ids(tool_tok, "<tool", "_call", ">", call_text[len("<tool_call>") :], "<|im_end|>")
    tool_calls = [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]
    context_call = {"role": "assistant", "content": "", "tool_calls": [{**tool_calls[0], "id": "c0"}]}
    traj = Trajectory(
        messages_and_choices=[
            {"role": "user", "content": "Look it up"},
            context_call,
            {"role": "tool", "tool_call_id": "c0", "content": "nothing"},
            make_choice(tool_tok, ids, tool_calls=tool_calls),
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        ],
        tools=TOOLS,
    )
    (seq,) = tokenize_trajectory(tool_tok, traj, 1.0)
    assert trained(seq) == ids
    text = tool_tok.decode(seq.token_ids)
    assert text.count('"name": "lookup"') == 3  # the tools list, the context call, the sampled call once
    # the context as the engine rendered it (arguments as a dict), not as the raw messages would render
    as_sampled = [template_message(m) for m in traj.messages()[:3]]
    assert text.startswith(tool_tok.apply_chat_template(as_sampled, tools=TOOLS, tokenize=False))
    assert text.endswith("<|im_start|>assistant\n" + call_text + "<|im_end|>\n")


def test_token_id_strings_are_used_when_the_choice_has_no_token_ids(tok):
    ids = split_ids(tok, "hel", "lo", "<|im_end|>")
    choice = make_choice(tok, ids, fmt="token_id")
    assert getattr(choice, "token_ids", None) is None
    traj = Trajectory(messages_and_choices=[{"role": "user", "content": "Hi"}, choice])
    (seq,) = tokenize_trajectory(tok, traj, 1.0)
    assert trained(seq) == ids


def test_vocabulary_lookup_is_the_last_resort_and_warns(tok):
    ids = split_ids(tok, "hel", "lo", " world", "<|im_end|>")
    traj = Trajectory(
        messages_and_choices=[{"role": "user", "content": "Hi"}, make_choice(tok, ids, fmt="vocab")]
    )
    with pytest.warns(UserWarning, match="drift"):
        (seq,) = tokenize_trajectory(tok, traj, 1.0)
    assert trained(seq) == ids
    decoded_tokens = Trajectory(messages_and_choices=[make_choice(tok, split_ids(tok, " world"), fmt="text")])
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
        tokenize_trajectory(tok, decoded_tokens, 1.0)


def test_additional_histories_share_the_advantage_and_pick_their_tools(tool_tok):
    ids = split_ids(tool_tok, "hel", "lo", "<|im_end|>")
    other_tools = [{"type": "function", "function": {"name": "summarise", "parameters": {}}}]
    traj = Trajectory(
        messages_and_choices=[{"role": "user", "content": "main"}, make_choice(tool_tok, ids)],
        tools=TOOLS,
        additional_histories=[
            History(messages_and_choices=[{"role": "user", "content": "sub"}, make_choice(tool_tok, ids)]),
            History(
                messages_and_choices=[{"role": "user", "content": "own"}, make_choice(tool_tok, ids)],
                tools=other_tools,
            ),
        ],
    )
    seqs = tokenize_trajectory(tool_tok, traj, 0.7, group_index=1, trajectory_index=4)
    assert len(seqs) == 3
    assert {(s.advantage, s.group_index, s.trajectory_index) for s in seqs} == {(0.7, 1, 4)}
    texts = [tool_tok.decode(s.token_ids) for s in seqs]
    assert "lookup" in texts[0] and "sub" in texts[1] and "lookup" in texts[1]
    assert "summarise" in texts[2] and "lookup" not in texts[2]
    assert all(trained(s) == ids for s in seqs)


def test_assistant_dicts_train_without_logprobs_when_allowed(tok):
    traj = Trajectory(
        messages_and_choices=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "hello world"},
            {"role": "user", "content": "again"},
            {"role": "assistant", "content": "bye"},
        ]
    )
    with pytest.raises(ValueError) as err:
        tokenize_trajectory(tok, traj, 1.0, group_index=2, trajectory_index=5)
    assert "group 2, trajectory 5" in str(err.value)
    assert "append completion.choices[0] (a Choice) instead of a message dict" in str(err.value)
    assert "allow_training_without_logprobs=True" in str(err.value)

    (seq,) = tokenize_trajectory(tok, traj, 1.0, allow_training_without_logprobs=True)
    check_shape(seq)
    eos = tok.eos_token_id
    assert spans(seq) == [
        tok.encode("hello world", add_special_tokens=False) + [eos],
        tok.encode("bye", add_special_tokens=False) + [eos],
    ]
    assert all(math.isnan(lp) for lp in seq.logprobs)
    assert tok.decode(seq.token_ids) == rendered(tok, traj, 4)


def test_assistant_dict_with_tool_calls_trains_the_rendered_call(tool_tok):
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}],
    }
    traj = Trajectory(messages_and_choices=[{"role": "user", "content": "Hi"}, call])
    (seq,) = tokenize_trajectory(tool_tok, traj, 1.0, allow_training_without_logprobs=True)
    assert (
        tool_tok.decode(trained(seq))
        == '<tool_call>{"name": "lookup", "arguments": "{}"}</tool_call><|im_end|>'
    )


def test_choice_without_logprobs(tok):
    choice = make_choice(tok, split_ids(tok, "hel", "lo", "<|im_end|>"), logprobs=False, fmt="none")
    traj = Trajectory(messages_and_choices=[{"role": "user", "content": "Hi"}, choice])
    with pytest.raises(ValueError) as err:
        tokenize_trajectory(tok, traj, 1.0, group_index=1, trajectory_index=3)
    message = str(err.value)
    assert "group 1, trajectory 3, messages_and_choices[1]" in message
    assert "logprobs=True" in message and "artnb's engines always return them" in message
    assert "allow_training_without_logprobs=True" in message
    (seq,) = tokenize_trajectory(tok, traj, 1.0, allow_training_without_logprobs=True)
    assert trained(seq) == tok.encode("hello<|im_end|>", add_special_tokens=False)
    assert all(math.isnan(lp) for lp in seq.logprobs)

    ids = split_ids(tok, "hel", "lo", "<|im_end|>")  # no logprobs but token ids: the ids are still used
    with_ids = Trajectory(
        messages_and_choices=[{"role": "user", "content": "Hi"}, make_choice(tok, ids, logprobs=False)]
    )
    (seq,) = tokenize_trajectory(tok, with_ids, 1.0, allow_training_without_logprobs=True)
    assert trained(seq) == ids and all(math.isnan(lp) for lp in seq.logprobs)


def test_token_ids_and_logprobs_must_match_in_number(tok):
    choice = make_choice(tok, split_ids(tok, "hel", "lo"))
    choice.logprobs.content.pop()
    traj = Trajectory(messages_and_choices=[{"role": "user", "content": "Hi"}, choice])
    with pytest.raises(
        ValueError, match=r"group 0, trajectory 1, messages_and_choices\[1\].*2 token ids but 1"
    ):
        tokenize_trajectory(tok, traj, 1.0, trajectory_index=1)


def test_placeholder_text_in_a_message_is_an_error_not_a_silent_misplacement(tok):
    choice = make_choice(tok, split_ids(tok, "hel", "lo"))
    traj = Trajectory(messages_and_choices=[{"role": "user", "content": "say <|artnb_turn_0|>"}, choice])
    with pytest.raises(ValueError, match="expected each of 0..0 once"):
        tokenize_trajectory(tok, traj, 1.0)


# --- tokenize_groups -------------------------------------------------------------------------------------------


def traj_with_reward(tok, reward: float, words: str = "hello") -> Trajectory:
    ids = split_ids(tok, *words.split("|"), "<|im_end|>")
    return Trajectory(
        messages_and_choices=[{"role": "user", "content": "Hi"}, make_choice(tok, ids)], reward=reward
    )


def test_group_of_one_is_rejected(tok):
    groups = [
        TrajectoryGroup([traj_with_reward(tok, 0), traj_with_reward(tok, 1)]),
        TrajectoryGroup([traj_with_reward(tok, 1)]),
    ]
    with pytest.raises(ValueError, match="group 1 has 1 trajectory; GRPO needs >= 2 to compare"):
        tokenize_groups(tok, groups)


def test_a_group_whose_other_rollouts_failed_is_left_out_and_the_others_train(tok):
    """max_exceptions let 3 of a group's 4 rollouts fail: that group has nothing to compare, the rest train."""
    failed = [RuntimeError("tool server down")] * 3
    groups = [
        TrajectoryGroup([traj_with_reward(tok, 0), traj_with_reward(tok, 1)]),
        TrajectoryGroup([traj_with_reward(tok, 1)], exceptions=failed),
        TrajectoryGroup([traj_with_reward(tok, 1), traj_with_reward(tok, 0)]),
    ]
    with pytest.warns(UserWarning, match=r"group 1 has 1 finished rollout\(s\) \(3 failed.*left out"):
        batch = tokenize_groups(tok, groups)
    assert {s.group_index for s in batch.sequences} == {0, 2}
    assert batch.metrics["num_groups_too_small"] == 1 and batch.metrics["num_groups_trainable"] == 2


def test_when_every_group_lost_its_rollouts_nothing_is_left_and_the_reason_says_so(tok):
    groups = [TrajectoryGroup([traj_with_reward(tok, 1)], exceptions=[RuntimeError("down")])] * 2
    with pytest.warns(UserWarning, match="left out"):
        batch = tokenize_groups(tok, groups)
    assert not batch.sequences
    assert batch.skipped_reason is not None and "fewer than 2 finished rollouts" in batch.skipped_reason


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_reward_is_rejected(tok, bad):
    groups = [TrajectoryGroup([traj_with_reward(tok, 0), traj_with_reward(tok, bad)])]
    with pytest.raises(ValueError, match="group 0, trajectory 1 has reward"):
        tokenize_groups(tok, groups)


@pytest.mark.parametrize("huge", [1e308, -1e13])
def test_a_reward_too_large_to_compare_is_rejected_with_the_fix(tok, huge):
    groups = [TrajectoryGroup([traj_with_reward(tok, 0), traj_with_reward(tok, huge)])]
    with pytest.raises(
        ValueError, match=r"trajectory 1 has reward .*beyond \+-1e\+12.*Scale the reward down"
    ):
        tokenize_groups(tok, groups)


def test_a_bad_trajectory_anywhere_fails_the_whole_batch(tok):
    """An assistant message dict where a Choice belongs is the usual mistake: it is refused, even in a group that
    teaches nothing."""
    dict_turn = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "hello"}]
    no_choice = Trajectory(messages_and_choices=dict_turn, reward=1.0)
    groups = [
        TrajectoryGroup([traj_with_reward(tok, 0), traj_with_reward(tok, 1)]),
        TrajectoryGroup([traj_with_reward(tok, 1), no_choice]),
    ]  # equal rewards: would be skipped
    with pytest.raises(ValueError, match="group 1, trajectory 1 has no trainable turn"):
        tokenize_groups(tok, groups)


def test_an_agent_that_never_got_a_turn_is_left_out_and_counted(tok):
    """A game that ended before one role played (Codenames' operative after an invalid clue) has a history with
    no assistant message: it trains nothing, and the rest of the batch trains, as in ART."""
    never_played = Trajectory(messages_and_choices=[{"role": "system", "content": "You guess."}], reward=0.0)
    groups = [TrajectoryGroup([traj_with_reward(tok, 1), never_played, traj_with_reward(tok, 0.25)])]
    batch = tokenize_groups(tok, groups)
    assert {s.trajectory_index for s in batch.sequences} == {0, 2}
    assert batch.metrics["num_histories_without_turns"] == 1
    alone = [TrajectoryGroup([never_played, Trajectory(messages_and_choices=[], reward=1.0)])]
    nothing = tokenize_groups(tok, alone)
    assert nothing.sequences == [] and "has an assistant turn" in nothing.skipped_reason


@pytest.mark.parametrize("scale", [True, False])
def test_advantages_equal_group_advantages(tok, scale):
    rewards = [[0.0, 1.0, 3.0, 0.5], [2.0, -1.0]]
    groups = [TrajectoryGroup([traj_with_reward(tok, r) for r in rs]) for rs in rewards]
    batch = tokenize_groups(tok, groups, scale_rewards=scale)
    got = {(s.group_index, s.trajectory_index): s.advantage for s in batch.sequences}
    want = {(gi, ti): a for gi, rs in enumerate(rewards) for ti, a in enumerate(group_advantages(rs, scale))}
    assert got == want
    assert batch.skipped_reason is None
    m = batch.metrics
    assert (m["num_groups"], m["num_trajectories"], m["num_groups_trainable"], m["num_sequences"]) == (
        2,
        6,
        2,
        6,
    )
    assert m["reward"] == pytest.approx(5.5 / 6)
    assert m["reward_std_dev"] == pytest.approx((math.sqrt(1.296875) + 1.5) / 2)
    assert m["num_tokens"] == sum(len(s.token_ids) for s in batch.sequences)
    assert m["num_trainable_tokens"] == 6 * len(split_ids(tok, "hello", "<|im_end|>"))


def test_zero_advantage_trajectories_are_skipped_and_explained(tok):
    equal = [TrajectoryGroup([traj_with_reward(tok, 0.1) for _ in range(3)]) for _ in range(4)]
    batch = tokenize_groups(tok, equal)
    assert batch.sequences == []
    assert batch.skipped_reason == (
        "all 4 groups had equal rewards within the group, so every advantage is 0; vary the scenario or the reward"
    )
    assert batch.metrics["num_zero_advantage_skipped"] == 12
    assert batch.metrics["num_groups_trainable"] == 0

    mixed = tokenize_groups(tok, [TrajectoryGroup([traj_with_reward(tok, r) for r in (0, 1, 2)]), *equal[:1]])
    assert sorted((s.group_index, s.trajectory_index) for s in mixed.sequences) == [(0, 0), (0, 2)]
    assert mixed.metrics["num_zero_advantage_skipped"] == 4
    assert mixed.metrics["num_groups_trainable"] == 1


def test_too_long_sequences_train_on_their_first_tokens_and_keep_their_advantage(tok):
    """The long rollout is the group's success here: dropped after the advantages were computed (as ART's
    LocalBackend does), the step would train only the failure's negative advantage."""
    short, long = traj_with_reward(tok, 0), traj_with_reward(tok, 1, "a|" * 40)
    limit = len(tokenize_trajectory(tok, short, 1.0)[0].token_ids) + 3
    full = tokenize_trajectory(tok, long, 1.0)[0]
    assert len(full.token_ids) > limit
    with pytest.warns(
        UserWarning, match=rf"1 sequence\(s\) of up to {len(full.token_ids)} tokens .* first {limit}"
    ):
        batch = tokenize_groups(tok, [TrajectoryGroup([short, long])], max_seq_length=limit)
    cut = batch.sequences[1]
    assert [s.trajectory_index for s in batch.sequences] == [0, 1] and cut.advantage > 0
    assert (cut.token_ids, cut.assistant_mask) == (full.token_ids[:limit], full.assistant_mask[:limit])
    assert str(cut.logprobs) == str(full.logprobs[:limit])  # aligned (NaN where no logprob: compared as text)
    assert 0 < cut.num_trainable_tokens() < full.num_trainable_tokens()
    assert (batch.metrics["num_truncated_too_long"], batch.metrics["num_dropped_too_long"]) == (1, 0)
    with pytest.warns(UserWarning, match="no sampled token among its first max_seq_length=5"):
        empty = tokenize_groups(tok, [TrajectoryGroup([short, long])], max_seq_length=5)
    assert empty.sequences == [] and empty.metrics["num_dropped_too_long"] == 2
    assert "no sampled token within their first max_seq_length" in empty.skipped_reason


# The tiny tokenizer's template with a marker written first when the template variable `greeting` is set.
GREETING = "{% if greeting is defined %}{{ greeting }}{% endif %}"


def test_template_kwargs_reach_the_rendered_text_of_choices_and_dicts(tok):
    """The template's variables (`_internal_config["chat_template_kwargs"]`) render the conversation as the
    engine rendered the prompt, also around an assistant dict, whose body is rendered a second time."""
    greeting = copy.deepcopy(tok)
    greeting.chat_template = GREETING + tok.chat_template
    ids = split_ids(tok, "O", "k", "<|im_end|>")
    traj = Trajectory(
        messages_and_choices=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "hello world"},
            {"role": "user", "content": "again"},
            make_choice(tok, ids),
        ]
    )
    kwargs = {"greeting": "MARK-7"}
    (seq,) = tokenize_trajectory(
        greeting, traj, 1.0, allow_training_without_logprobs=True, template_kwargs=kwargs
    )
    text = greeting.decode(seq.token_ids)
    assert text.startswith("MARK-7<|im_start|>")
    assert text == greeting.apply_chat_template(traj.messages(), tokenize=False, greeting="MARK-7")
    assert spans(seq)[-1] == ids  # the sampled ids still train as they were sampled
    (plain,) = tokenize_trajectory(greeting, traj, 1.0, allow_training_without_logprobs=True)
    assert "MARK-7" not in greeting.decode(plain.token_ids)
    batch = tokenize_groups(
        greeting,
        [TrajectoryGroup([traj_with_reward(tok, 0), traj_with_reward(tok, 1)])],
        template_kwargs=kwargs,
    )
    assert all(greeting.decode(s.token_ids).startswith("MARK-7") for s in batch.sequences)


def test_the_configured_template_is_the_one_the_trainer_renders_with(tmp_path):
    """`_internal_config["chat_template"]` (or `chat_template_path`) becomes the trainer's tokenizer's
    template, and SFT renders with the template variables as RL does."""
    template = tmp_path / "template.jinja"
    own = str(AutoTokenizer.from_pretrained(artnb.models.tiny()).chat_template)
    template.write_text("[configured]" + own)
    settings = resolve_internal_config({"chat_template_path": str(template)}, on_cuda=False)
    tokenizer = model_tokenizer(artnb.models.tiny(), settings)
    traj = Trajectory(
        messages_and_choices=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "yes"}]
    )
    (seq,) = tokenize_trajectory(tokenizer, traj, 1.0, allow_training_without_logprobs=True)
    assert str(tokenizer.decode(seq.token_ids)).startswith("[configured]<|im_start|>")
    tokenizer.chat_template = GREETING + "[configured]" + own
    (sft,) = tokenize_sft(
        tokenizer, [traj], TrainSFTConfig(batch_size=1), template_kwargs={"greeting": "MARK-8"}
    ).sequences
    assert str(tokenizer.decode(sft.token_ids)).startswith("MARK-8[configured]<|im_start|>")


DROPS_TOOLS = "this model's chat template does not render the tool definitions"
DROPS_CALLS = "this model's chat template does not render an assistant message's tool_calls"


def tool_call_trajectory(tok, tools=TOOLS) -> tuple[Trajectory, list[int], list[int]]:
    """A tool call, its result, and a reply sampled after it."""
    call = split_ids(tok, '{"name": "lookup"}', "<|im_end|>")
    reply = split_ids(tok, "It", " is", " 4", "2", "<|im_end|>")
    tool_calls = [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]
    traj = Trajectory(
        messages_and_choices=[
            {"role": "user", "content": "What is it?"},
            make_choice(tok, call, tool_calls=tool_calls),
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
            make_choice(tok, reply),
        ],
        tools=tools,
    )
    return traj, call, reply


def tool_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "chat template does not render" in str(w.message)]


def with_own_template(tok, tag: str):
    """A copy of `tok` whose template renders the same text but counts as a template not yet warned about."""
    t = copy.deepcopy(tok)
    t.chat_template = tok.chat_template + "{# " + tag + " #}"
    return t


def test_a_template_that_drops_tools_and_tool_calls_warns_once_and_trains_as_sampled(tok):
    """SmolLM2's template (the embedded and tiny models') renders neither: the user is told what it means and
    how to fix it, once, and the sampled ids still train unchanged."""
    own = with_own_template(tok, "drops")
    traj, call, reply = tool_call_trajectory(own)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        (seq,) = tokenize_trajectory(own, traj, 1.0)
        tokenize_groups(own, [TrajectoryGroup([traj.model_copy(update={"reward": r}) for r in (0.0, 1.0)])])
    messages = tool_warnings(record)
    assert len(messages) == 2  # one per kind, however often the template is used again
    assert DROPS_TOOLS in messages[0] and "the model never saw them" in messages[0]
    assert DROPS_CALLS in messages[1] and "off-policy" in messages[1]
    assert all("Qwen" in m and "chat_template" in m and "system prompt" in m for m in messages)
    assert spans(seq) == [call, reply]
    # what the engine sampled the reply from has no call; the trained sequence keeps the sampled one
    assert "lookup" not in rendered(own, traj, 3, TOOLS)
    assert own.decode(seq.token_ids).count('{"name": "lookup"}') == 1


def test_a_template_that_renders_tools_and_tool_calls_does_not_warn():
    """The same conversation through `_internal_config["chat_template"]`, set to a template that renders both."""
    settings = resolve_internal_config({"chat_template": TOOL_TEMPLATE}, on_cuda=False)
    tokenizer = model_tokenizer(artnb.models.tiny(), settings)
    traj, _, reply = tool_call_trajectory(tokenizer)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        (seq,) = tokenize_trajectory(tokenizer, traj, 1.0)
    assert tool_warnings(record) == []
    assert spans(seq)[-1] == reply


def test_a_conversation_without_tools_does_not_warn(tok):
    own = with_own_template(tok, "no tools")
    ids = split_ids(tok, "hel", "lo", "<|im_end|>")
    plain = Trajectory(messages_and_choices=[{"role": "user", "content": "Hi"}, make_choice(own, ids)])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        tokenize_trajectory(own, plain, 1.0)
        assert tool_warnings(record) == []
        tokenize_trajectory(
            own, plain.model_copy(update={"tools": TOOLS}), 1.0
        )  # the same template, with tools
        assert [DROPS_TOOLS in m for m in tool_warnings(record)] == [True]


def test_history_messages_render_as_the_engine_rendered_them(tool_tok):
    """An assistant dict with content None and JSON-string arguments (as the OpenAI SDK returns them): the trainer
    renders it as the engine did (content "", arguments as a dict), not refused or double-encoded."""
    reply = split_ids(tool_tok, "It", " is", " 4", "2", "<|im_end|>")
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}
    history = [
        {"role": "user", "content": "What is it?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "42"}]},
    ]
    traj = Trajectory(messages_and_choices=[*history, make_choice(tool_tok, reply)], tools=TOOLS)
    (seq,) = tokenize_trajectory(tool_tok, traj, 1.0)
    text = tool_tok.decode(seq.token_ids)
    assert '"arguments": {"q": "x"}' in text and "<|im_start|>tool\n42<|im_end|>" in text
    engine_prompt = tool_tok.apply_chat_template(
        [template_message(m) for m in history], tools=TOOLS, tokenize=False
    )
    assert text.startswith(engine_prompt)
