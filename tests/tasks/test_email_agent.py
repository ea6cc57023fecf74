"""ART·E: the generated inbox, its SQLite search, tool errors, scoring, and rollouts against real servers.

The happy path of tool calling (search -> read -> answer) runs against a small local HTTP server that speaks
the OpenAI chat completions protocol and plays a scripted hosted model; it stands in for a paid API, and every
artnb piece in the loop is the real one.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections.abc import Callable

import pytest
import uvicorn
from fastapi import FastAPI, Request
from openai.types.chat.chat_completion import Choice

import artnb as art
from artnb.core.tokenize import tokenize_trajectory
from artnb.tasks import email_agent
from artnb.tasks.email_agent import (
    PLANTERS,
    Episode,
    ToolError,
    answer_score,
    generate_inbox,
    get_scenario,
    score_episode,
)


def all_facts(seed: int) -> email_agent.Inbox:
    return generate_inbox(seed, n_emails=30, n_facts=len(PLANTERS))


def test_generator_is_deterministic_per_seed_and_differs_across_seeds():
    a, b = generate_inbox.__wrapped__(5), generate_inbox.__wrapped__(5)  # bypass the cache
    assert a is not b and a.emails == b.emails and a.questions == b.questions
    other = generate_inbox.__wrapped__(6)
    assert [e.body for e in other.emails] != [e.body for e in a.emails]
    assert get_scenario(5) == get_scenario(5)
    assert len({get_scenario(s).question for s in range(20)}) > 5
    assert get_scenario(5, n_facts=9).inbox() is generate_inbox(5, 30, 9)  # cached: one index per inbox
    pinned = get_scenario(0, n_emails=12)  # a quiet change to the generator fails here
    assert (pinned.question, pinned.answer) == ("When is the hiring plan due?", "December 5")


def test_inbox_shape():
    inbox = generate_inbox(11, n_emails=12)
    assert len(inbox.emails) == 12 and len(inbox.questions) == 4
    assert len({e.message_id for e in inbox.emails}) == 12
    assert [e.sent for e in inbox.emails] == sorted(e.sent for e in inbox.emails)
    assert all(e.sent.date() <= inbox.today for e in inbox.emails)
    assert any(e.subject.startswith("Re: ") for e in all_facts(11).emails)  # the offsite thread
    with pytest.raises(ValueError, match="n_emails=3 is too small"):
        generate_inbox(1, n_emails=3)
    with pytest.raises(ValueError, match="n_facts=0"):
        generate_inbox(1, n_facts=0)


def test_every_answer_appears_in_its_source_email():
    for seed in range(60):
        inbox = all_facts(seed)
        assert len(inbox.questions) == len(PLANTERS)
        for q in inbox.questions:
            for source in q.source_ids:
                text = inbox.email(source).render()
                assert q.answer in text or any(form in text for form in q.accepted), (seed, q)


def test_the_offsite_update_overrides_the_first_plan():
    inbox = next(all_facts(s) for s in range(10))
    q = next(q for q in inbox.questions if "offsite" in q.question)
    results = inbox.search_inbox(["offsite"])
    assert len(results) == 2  # the plan and the reply that moves it
    (update,) = q.source_ids
    assert inbox.email(update).subject == "Re: Team offsite planning"
    first = next(r for r in results if r["message_id"] != update)
    assert q.answer not in inbox.read_email(first["message_id"])


def test_search_finds_planted_facts_by_keyword():
    for seed in range(15):
        inbox = all_facts(seed)
        for q in inbox.questions:
            found = [r["message_id"] for r in inbox.search_inbox([q.answer])]
            assert set(q.source_ids) <= set(found), (seed, q)
    inbox = all_facts(0)
    budget = next(q for q in inbox.questions if "budget code" in q.question)
    (hit,) = inbox.search_inbox(["budget", "code"])  # keywords are AND-ed
    assert hit["message_id"] == budget.source_ids[0] and "budget code" in hit["snippet"]
    assert inbox.search_inbox(["budget", "lighthouses"]) == []
    assert inbox.search_inbox(["budgets", "codes"]) == [hit]  # stemmed


def test_filters_narrow_results():
    inbox = all_facts(2)
    everything = inbox.search_inbox([], sent_after="2000-01-01", max_results=50)
    assert len(everything) == 30
    sender = inbox.emails[0].sender
    by_sender = inbox.search_inbox([], from_addr=sender.address, max_results=50)
    assert 0 < len(by_sender) < 30
    assert all(inbox.email(r["message_id"]).sender == sender for r in by_sender)
    by_name = inbox.search_inbox([], from_addr=sender.name.split()[0].lower(), max_results=50)
    assert {r["message_id"] for r in by_sender} <= {r["message_id"] for r in by_name}

    colleague = inbox.people[3]
    to_colleague = inbox.search_inbox([], to_addr=colleague.address, max_results=50)
    assert 0 < len(to_colleague) < 30
    for r in to_colleague:
        email = inbox.email(r["message_id"])
        assert colleague in email.to + email.cc

    middle = inbox.emails[15].sent.date()
    after = inbox.search_inbox([], sent_after=middle.isoformat(), max_results=50)
    before = inbox.search_inbox([], sent_before=middle.isoformat(), max_results=50)
    assert len(after) + len(before) == 30 and after and before
    assert all(r["date"] >= middle.isoformat() for r in after)
    assert all(r["date"] < middle.isoformat() for r in before)
    assert len(inbox.search_inbox([], sent_after="2000-01-01", max_results=3)) == 3

    keyword_and_date = inbox.search_inbox(["the"], sent_after=middle.isoformat(), max_results=50)
    assert {r["message_id"] for r in keyword_and_date} <= {r["message_id"] for r in after}


def test_bad_tool_calls_become_error_strings_the_model_sees():
    s = get_scenario(4, n_emails=12)
    episode = Episode(generate_inbox(4, 12), s)
    bad = [
        ("read_email", {"message_id": "<nope@northwind.example>"}, "no email has message_id"),
        ("read_email", "{not json", "not valid JSON"),
        ("read_email", {}, "bad arguments for read_email"),
        ("send_email", {"to": "x"}, "there is no tool 'send_email'"),
        ("search_inbox", {"keywords": ["code"], "sent_after": "last tuesday"}, "YYYY-MM-DD"),
        ("search_inbox", {"keywords": ["code"], "max_results": 500}, "max_results"),
        ("search_inbox", {"keywords": [3]}, "keywords must be a list of strings"),
        ("search_inbox", {"keywords": []}, "at least one keyword"),
        ("search_inbox", {"keywords": ["x"], "limit": 3}, "unexpected keyword argument 'limit'"),
        ("return_final_answer", {"answer": 42, "sources": []}, "answer must be a string"),
        ("return_final_answer", "[1, 2]", "must be a JSON object"),
    ]
    for i, (name, arguments, message) in enumerate(bad, start=1):
        result = episode.call(name, arguments)
        assert result.startswith("Error: ") and message in result, (name, result)
        assert episode.tool_errors == i and not episode.done
    # FTS5 query syntax in a keyword is searched as text, never a crash
    assert not episode.call("search_inbox", {"keywords": ['"AND OR NEAR(', "*"]}).startswith("Error")
    email = generate_inbox(4, 12).emails[0]
    bare = email.message_id.strip("<>")
    assert episode.call("read_email", json.dumps({"message_id": bare})).startswith(
        f"Message-ID: {email.message_id}"
    )
    with pytest.raises(ToolError):  # the Python API raises; only the tool layer turns errors into text
        generate_inbox(4, 12).read_email("missing")


def answered(seed: int, answer: str | None, sources: list[str], **state) -> float:
    s = get_scenario(seed, n_emails=12)
    episode = Episode(generate_inbox(seed, 12), s, **state)
    if answer is not None:
        episode.call("return_final_answer", {"answer": answer, "sources": sources})
    return score_episode(episode, turns=3).reward


def test_scoring_orders_answers():
    s = get_scenario(9, n_emails=12)
    right, wrong_ids = list(s.source_ids), ["<00000000@northwind.example>"]
    both = answered(9, s.answer, right)
    answer_only = answered(9, s.answer, wrong_ids)
    wrong = answered(9, "I am not sure", right)
    wrong_no_sources = answered(9, "I am not sure", [])
    nothing = answered(9, None, [])
    best_nothing = answered(9, None, [], seen_ids=set(right), read_ids=set(right))
    assert both > answer_only > wrong >= wrong_no_sources > best_nothing > nothing
    assert both == pytest.approx(1.25 - 0.04) and nothing == pytest.approx(-0.5)  # no turn charge unanswered


def test_answer_score_forms_and_partial_credit():
    assert answer_score("It lands at 14:05.", "14:05") == 1.0
    assert answer_score("2:05 PM", "14:05", ("2:05 pm",)) == 1.0
    assert answer_score("qx 4471", "QX-4471") == 1.0
    assert answer_score("4471", "QX-4471") == 0.25  # half credit times half the words
    assert answer_score("14:55", "14:05") == 0.25  # the hour right, the minutes wrong
    assert answer_score("15:55", "14:05") == 0.0
    assert answer_score("the offsite is in lisbon now", "Lisbon") == 1.0
    assert answer_score(" ".join(["Lisbon"] * 50), "Lisbon") == 0.0  # a dump, not an answer


async def test_rollout_on_a_real_engine(tiny_model, tiny_tokenizer):
    traj = await email_agent.rollout(tiny_model, 7, **email_agent.QUICK)
    assert traj.tools == email_agent.TOOLS
    system, user, first, *_ = traj.messages_and_choices
    assert isinstance(first, Choice) and first.logprobs.content
    assert user["content"] == get_scenario(7, 12).question and "search_inbox" in system["content"]
    assert 1 <= traj.metrics["turns"] <= email_agent.QUICK["max_turns"]
    assert math.isfinite(traj.reward)
    for key in ("correct", "sources_ok", "tool_errors", "duration"):
        assert key in traj.metrics
    assert traj.metadata["answer"] == get_scenario(7, 12).answer
    (sequence,) = tokenize_trajectory(tiny_tokenizer, traj, advantage=1.0)
    assert sequence.num_trainable_tokens() >= 1


# ---- a scripted "hosted model" over real HTTP ----------------------------------------------------------------

Script = Callable[[list[dict]], dict]


class ScriptedServer:
    """An OpenAI-compatible /v1/chat/completions endpoint whose replies come from `self.script(messages)`."""

    def __init__(self) -> None:
        self.script: Script | None = None
        self.requests: list[dict] = []
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def complete(request: Request) -> dict:
            body = await request.json()
            self.requests.append(body)
            message = {"role": "assistant", "content": None, **self.script(body["messages"])}
            return {
                "id": f"chatcmpl-{len(self.requests)}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
                        "logprobs": None,
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "the scripted server did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1"


@pytest.fixture(scope="module")
def scripted():
    server = ScriptedServer()
    base_url = server.start()
    model = art.Model(name="scripted-hosted-model", inference_base_url=base_url, inference_api_key="sk-test")
    yield server, model
    server.server.should_exit = True
    server.thread.join(timeout=10)


def call(name: str, **arguments) -> dict:
    return {
        "tool_calls": [
            {
                "id": f"call_{name}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
        ]
    }


def researcher(keywords: list[str], answer: str, first_bad_read: bool = False) -> Script:
    """A competent agent: search, read the top hit, answer with the email it read as the source."""

    def script(messages: list[dict]) -> dict:
        tools = [m for m in messages if m["role"] == "tool"]
        if first_bad_read and not tools:
            return call("read_email", message_id="<deadbeef@northwind.example>")
        last = tools[-1]["content"] if tools else ""
        if not tools or last.startswith("Error"):
            return call("search_inbox", keywords=keywords)
        if last.startswith("["):
            return call("read_email", message_id=json.loads(last)[0]["message_id"])
        (message_id,) = re.findall(r"^Message-ID: (\S+)$", last, re.M)
        return call("return_final_answer", answer=answer, sources=[message_id])

    return script


async def test_scripted_hosted_model_searches_reads_and_answers(scripted):
    server, model = scripted
    s = get_scenario(21, n_emails=12)
    server.script = researcher([s.answer], f"It is {s.answer}.")
    server.requests.clear()
    traj = await email_agent.rollout(model, s, temperature=0, constrained=False)
    assert traj.metrics["answered"] and traj.metrics["correct"] and traj.metrics["sources_ok"]
    assert traj.metrics["turns"] == 3 and traj.metrics["tool_errors"] == 0
    assert traj.reward == pytest.approx(1.25 - 2 * 0.02)
    roles = [m["role"] for m in traj.messages()]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant", "tool"]
    assert traj.trainable_turns() == 3
    request = server.requests[-1]
    assert request["tools"] == email_agent.TOOLS and request["logprobs"] is True
    assert request["model"] == "scripted-hosted-model" and request["temperature"] == 0
    assert "response_format" not in request  # a hosted model calls tools natively
    assert "<tool_call>" in traj.messages()[0]["content"]  # the example call, for templates without tools
    tool_results = [m for m in traj.messages() if m["role"] == "tool"]
    assert tool_results[0]["tool_call_id"] == "call_search_inbox"
    assert s.answer in tool_results[1]["content"]  # the email it read


async def test_scripted_model_recovers_from_a_bad_message_id(scripted):
    server, model = scripted
    s = get_scenario(22, n_emails=12)
    server.script = researcher([s.answer], s.answer, first_bad_read=True)
    traj = await email_agent.rollout(model, 22, n_emails=12, constrained=False)
    first_result = next(m for m in traj.messages() if m["role"] == "tool")
    assert first_result["content"].startswith("Error: no email has message_id '<deadbeef@northwind.example>'")
    assert traj.metrics["tool_errors"] == 1 and traj.metrics["turns"] == 4 and traj.metrics["correct"]
    assert traj.reward == pytest.approx(1.25 - 3 * 0.02 - 0.05)


async def test_scripted_model_wrong_answer_and_turn_limit(scripted):
    server, model = scripted
    s = get_scenario(23, n_emails=12)
    server.script = researcher([s.answer], "Tuesday")
    wrong = await email_agent.rollout(model, s, constrained=False)
    assert wrong.metrics["answered"] and not wrong.metrics["correct"] and wrong.metrics["sources_ok"]
    server.script = lambda messages: call("search_inbox", keywords=["offsite"])  # never answers
    stuck = await email_agent.rollout(model, s, max_turns=2, constrained=False)
    assert stuck.metrics["turns"] == 2 and not stuck.metrics["answered"]
    server.script = lambda messages: {"content": "I don't know."}  # no tool call ends the episode
    silent = await email_agent.rollout(model, s, constrained=False)
    assert silent.metrics["turns"] == 1 and silent.reward == pytest.approx(-0.5)
    assert wrong.reward > stuck.reward and wrong.reward > silent.reward


async def test_constrained_replies_are_json_tool_calls(scripted):
    """On our engines the reply is a JSON object in the content (response_format); it counts as a tool call."""
    server, model = scripted
    s = get_scenario(24, n_emails=12)
    answer = {"name": "return_final_answer", "arguments": {"answer": s.answer, "sources": list(s.source_ids)}}
    server.script = lambda messages: {"content": json.dumps(answer)}
    traj = await email_agent.rollout(model, s)
    request = server.requests[-1]
    assert request["response_format"]["json_schema"]["schema"] == email_agent.TOOL_CALL_SCHEMA
    assert "<tool_call>" not in traj.messages()[0]["content"]
    assert traj.metrics["correct"] and traj.metrics["sources_ok"] and traj.metrics["turns"] == 1
    assert traj.reward == pytest.approx(1.25)
    assert traj.messages()[-1] == {
        "role": "tool",
        "tool_call_id": "json_call_1",
        "content": "Final answer recorded.",
    }
