"""Token rows of trainable turns, from live Choices and from logged message dicts."""

import math

from openai.types.chat.chat_completion import Choice

from artnb.core.tokens import is_trainable_turn, summarize_tokens, token_rows


def test_rows_from_a_choice_and_from_its_logged_form():
    choice = Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": "B2"},
            "logprobs": {
                "content": [
                    {
                        "token": "B",
                        "logprob": -0.2,
                        "top_logprobs": [{"token": "B", "logprob": -0.2}, {"token": "A", "logprob": -1.9}],
                    },
                    {"token": "2", "logprob": -3.0, "top_logprobs": []},
                    {"token": "<|im_end|>", "logprob": float("-inf"), "top_logprobs": []},
                ]
            },
        }
    )
    rows = token_rows(choice)
    assert [r.token for r in rows] == ["B", "2", "<|im_end|>"]
    assert rows[0].top == (("A", -1.9),)  # the sampled token is not its own alternative
    assert rows[1].prob == math.exp(-3.0) and rows[2].logprob is None
    logged = {
        "role": "assistant",
        "content": "B2",
        "trainable": True,
        "logprobs": [{"token": "B", "logprob": -0.2}],
    }
    assert is_trainable_turn(choice) and is_trainable_turn(logged) and not is_trainable_turn({"role": "user"})
    assert token_rows(logged)[0].logprob == -0.2
    s = summarize_tokens(rows)
    assert s.num_tokens == 3 and s.mean_logprob == -1.6 and [r.token for r in s.least_likely] == ["2", "B"]
    assert s.perplexity == math.exp(1.6)
    assert summarize_tokens([]).mean_logprob is None
    no_logprobs = Choice.model_validate(
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "x"}}
    )
    assert token_rows(no_logprobs) == []
