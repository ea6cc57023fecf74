"""strip_logprobs on a real trajectory: the copy has no logprobs, the original keeps them."""

import json

from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
from openai.types.chat.chat_completion_message import ChatCompletionMessage
from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob, TopLogprob

import artnb as art
from artnb.utils import strip_logprobs


def sampled_choice() -> Choice:
    tokens = [
        ChatCompletionTokenLogprob(
            token=t, logprob=-0.5, bytes=list(t.encode()), top_logprobs=[TopLogprob(token=t, logprob=-0.5)]
        )
        for t in ("X", " at", " 4")
    ]
    return Choice(
        index=0,
        finish_reason="stop",
        message=ChatCompletionMessage(role="assistant", content="X at 4"),
        logprobs=ChoiceLogprobs(content=tokens),
    )


def test_trajectory_copy_loses_logprobs_and_original_keeps_them():
    traj = art.Trajectory(
        messages_and_choices=[{"role": "user", "content": "your move"}, sampled_choice()],
        reward=1.0,
        metrics={"won": True},
    )
    group = art.TrajectoryGroup([traj, traj.model_copy(deep=True)])

    light = strip_logprobs(group)

    assert isinstance(light, art.TrajectoryGroup) and light is not group
    for t in light.trajectories:
        choice = t.messages_and_choices[1]
        assert isinstance(choice, Choice) and choice.logprobs is None
        assert choice.message.content == "X at 4" and t.reward == 1.0 and t.metrics == {"won": True}
    assert len(group.trajectories[0].messages_and_choices[1].logprobs.content) == 3  # untouched
    assert "logprobs" not in json.dumps(strip_logprobs(traj).for_logging())


def test_dicts_lists_and_tuples():
    record = {
        "logprobs": [1],
        "turns": [{"logprobs": {"content": []}, "text": "hi"}],
        "pair": ({"logprobs": 1}, 2),
    }
    assert strip_logprobs(record) == {"turns": [{"text": "hi"}], "pair": ({}, 2)}
    assert record["logprobs"] == [1]  # a copy was changed, not the argument


def test_anything_else_passes_through_unharmed():
    import threading

    lock = threading.Lock()  # cannot be deep-copied: returned as is
    assert strip_logprobs(lock) is lock
    assert strip_logprobs(len) is len and strip_logprobs(3) == 3 and strip_logprobs(None) is None

    class Node:
        def __init__(self):
            self.logprobs = [0.1]
            self.parent = self  # a cycle

    node = strip_logprobs(Node())
    assert node.logprobs is None and node.parent is node
