"""art.langgraph: a LangGraph agent with a tool, its run captured as one trajectory of the tokens it sampled."""

from __future__ import annotations

import math

import pytest
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode
from pydantic import BaseModel, Field
from served import served_model
from transformers import AutoTokenizer

import artnb as art
from artnb import models
from artnb.core.tokenize import tokenize_trajectory
from artnb.langgraph import init_chat_model, wrap_rollout

SYSTEM = "You answer weather questions with the get_weather tool."
QUESTION = "Weather in Oslo?"


class City(BaseModel):
    city: str = Field(max_length=8)  # bounded, so the tiny random model's forced call ends within max_tokens


@tool(args_schema=City)
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"Sunny in {city}"


WEATHER_SCHEMA = convert_to_openai_tool(get_weather)  # what LangChain sends


@pytest.fixture(scope="module")
def tiny() -> str:
    return models.tiny()


@pytest.fixture(scope="module")
async def policy(tiny, tmp_path_factory):
    """The tiny model served by the HF engine, as an art.Model pointing at it."""
    async with served_model(tiny, tmp_path_factory.mktemp("logs")) as model:
        yield model


def graph():
    """Agent calls the tool once (forced, so the tiny random model's call is valid), the tool runs, agent answers."""

    async def agent(state: MessagesState) -> dict:
        first = len(state["messages"]) == 2
        llm = init_chat_model(max_tokens=100 if first else 20, seed=1 if first else 2).bind_tools(
            [get_weather], tool_choice="required" if first else "none", parallel_tool_calls=False
        )
        return {"messages": [await llm.ainvoke(state["messages"])]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_node("tools", ToolNode([get_weather]))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", lambda s: "tools" if s["messages"][-1].tool_calls else END)
    builder.add_edge("tools", "agent")
    return builder.compile()


async def rollout() -> art.Trajectory:
    result = await graph().ainvoke({"messages": [SystemMessage(SYSTEM), HumanMessage(QUESTION)]})
    return art.Trajectory(
        reward=float(len(result["messages"])), messages_and_choices=[], metadata={"kind": "lg"}
    )


async def test_a_langgraph_run_is_one_trajectory_of_the_sampled_tokens(policy, tiny):
    captured = await wrap_rollout(policy, rollout)()
    assert captured.reward == 5.0 and captured.metadata == {"kind": "lg"}, "the rollout's own fields are kept"
    roles = [m["role"] for m in captured.messages()]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    assert captured.trainable_turns() == 2 and captured.tools[0]["function"]["name"] == "get_weather"
    call = captured.messages_and_choices[2].message.tool_calls[0]
    tool_message = captured.messages_and_choices[3]
    assert tool_message["tool_call_id"] == call.id and tool_message["content"].startswith("Sunny in")

    # The same conversation written by hand with the OpenAI client: the same requests, so the same samples.
    client = policy.openai_client()
    messages: list = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    first = await client.chat.completions.create(
        model="base", messages=messages, tools=[WEATHER_SCHEMA], tool_choice="required",
        parallel_tool_calls=False, max_tokens=100, seed=1, temperature=1.0,
    )  # fmt: skip
    called = first.choices[0].message.tool_calls[0]
    messages += [
        first.choices[0],
        {"role": "tool", "tool_call_id": called.id, "content": tool_message["content"]},
    ]
    history = [m if isinstance(m, dict) else m.message.model_dump(exclude_none=True) for m in messages]
    second = await client.chat.completions.create(
        model="base", messages=history, tools=[WEATHER_SCHEMA], tool_choice="none",
        parallel_tool_calls=False, max_tokens=20, seed=2, temperature=1.0,
    )  # fmt: skip
    by_hand = art.Trajectory(messages_and_choices=[*messages, second.choices[0]], tools=[WEATHER_SCHEMA])

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    (mine,) = tokenize_trajectory(tokenizer, captured, 1.0)
    (theirs,) = tokenize_trajectory(tokenizer, by_hand, 1.0)
    assert mine.token_ids == theirs.token_ids
    assert mine.assistant_mask == theirs.assistant_mask and sum(mine.assistant_mask) > 0
    assert [x for x in mine.logprobs if not math.isnan(x)] == pytest.approx(
        [x for x in theirs.logprobs if not math.isnan(x)], abs=1e-5
    )


async def test_init_chat_model_outside_a_wrapped_rollout_says_what_to_do(policy):
    with pytest.raises(RuntimeError, match="wrap_rollout"):
        init_chat_model()
    with pytest.raises(RuntimeError, match="init_chat_model\\('base'\\) must run inside"):
        init_chat_model("base")
    assert init_chat_model(policy).model_name == "base"

    async def arts_call() -> (
        float
    ):  # ART's notebook: init_chat_model(model.get_inference_name(), temperature=1.0)
        return float(init_chat_model(policy.get_inference_name(), temperature=1.0).model_name == "base")

    assert (await wrap_rollout(policy, arts_call)()).reward == 1.0
    group = await art.gather_trajectory_groups(
        [art.TrajectoryGroup(wrap_rollout(policy, rollout)() for _ in range(2))], pbar_desc=None
    )
    assert [t.trainable_turns() for t in group[0]] == [2, 2]
