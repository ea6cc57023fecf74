"""convert_litellm_choice_to_openai: content, tool calls and logprobs survive, built from litellm's own types."""

import pytest
from litellm.types.utils import ChatCompletionTokenLogprob, ChoiceLogprobs, Choices, Message, TopLogprob
from openai.types.chat.chat_completion import Choice

import artnb as art
from artnb.utils.litellm import convert_litellm_choice_to_openai


def token(text: str, logprob: float) -> ChatCompletionTokenLogprob:
    alt = TopLogprob(token=text.upper(), logprob=logprob - 1, bytes=list(text.upper().encode()))
    return ChatCompletionTokenLogprob(
        token=text,
        logprob=logprob,
        bytes=list(text.encode()),
        top_logprobs=[TopLogprob(token=text, logprob=logprob, bytes=list(text.encode())), alt],
    )


def test_round_trips_content_tool_calls_and_logprobs():
    litellm_choice = Choices(
        finish_reason="tool_calls",
        index=2,
        message=Message(
            role="assistant",
            content="Let me look.",
            tool_calls=[
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "search", "arguments": '{"q": "art"}'},
                }
            ],
        ),
        logprobs=ChoiceLogprobs(content=[token("Let", -0.25), token(" me", -1.5)]),
    )

    choice = convert_litellm_choice_to_openai(litellm_choice)

    assert isinstance(choice, Choice)
    assert (choice.index, choice.finish_reason) == (2, "tool_calls")
    assert choice.message.role == "assistant" and choice.message.content == "Let me look."
    (call,) = choice.message.tool_calls
    assert (call.id, call.type, call.function.name, call.function.arguments) == (
        "call_1",
        "function",
        "search",
        '{"q": "art"}',
    )
    tokens = choice.logprobs.content
    assert [(t.token, t.logprob, t.bytes) for t in tokens] == [
        ("Let", -0.25, [76, 101, 116]),
        (" me", -1.5, [32, 109, 101]),
    ]
    assert [(a.token, a.logprob) for a in tokens[1].top_logprobs] == [(" me", -1.5), (" ME", -2.5)]
    # it is a trainable turn of a trajectory, and the next request's history holds the tool call
    traj = art.Trajectory(messages_and_choices=[{"role": "user", "content": "find art"}, choice])
    assert traj.trainable_turns() == 1
    assert traj.messages()[-1]["tool_calls"][0]["function"]["name"] == "search"


def test_plain_answer_without_logprobs():
    choice = convert_litellm_choice_to_openai(Choices(message=Message(role="assistant", content="4")))
    assert (choice.message.content, choice.message.tool_calls, choice.logprobs, choice.finish_reason) == (
        "4",
        None,
        None,
        "stop",
    )


def test_logprobs_left_as_a_dict_are_converted():
    litellm_choice = Choices(message=Message(role="assistant", content="hi"))
    litellm_choice.logprobs = {
        "content": [{"token": "hi", "logprob": -0.1, "bytes": None, "top_logprobs": []}]
    }
    assert convert_litellm_choice_to_openai(litellm_choice).logprobs.content[0].logprob == -0.1


def test_wrong_input_is_explained():
    with pytest.raises(ValueError, match="role is 'user'"):
        convert_litellm_choice_to_openai(Choices(message=Message(role="user", content="hi")))
    with pytest.raises(ValueError, match="response.choices\\[0\\]"):
        convert_litellm_choice_to_openai(object())
