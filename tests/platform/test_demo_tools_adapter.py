"""The demo's tool-calling adapter, `weather-tools`, as a user meets it: `tessera demo` as a
subprocess and the official openai client. The adapter calls get_weather for a weather question
in a city it never saw in training, answers from the tool's result in one sentence, and the
round trip the demo prints works as pasted. The base model, which was never taught tools, still
returns a call whose arguments validate when `tool_choice` is "required": a grammar forces it.

The session's one demo process (conftest.py: shared_demo).
"""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from .demo_process import printed_commands, sh

BASE = "SmolLM2-135M-Instruct"
ADAPTER = "weather-tools"
#: The tool as the adapter was trained with it (scripts/train_demo_adapters.py: GET_WEATHER).
GET_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
#: Cities held out of the adapter's training (scripts/train_demo_adapters.py: CITIES, CITY_HOLD):
#: one word, three words, a non-ASCII letter. (Not every held-out city comes back exact: the
#: adapter writes "Copenhagen" as " Copenhagen"; behaviour.json's tools_eval has the figures.)
HELD_OUT = ["Melbourne", "Rio de Janeiro", "Reykjavík"]


@pytest.fixture(scope="module")
def demo(shared_demo, tmp_path_factory):
    """(the session's demo, a folder to paste its commands in, an openai client with its key)."""
    client = openai.OpenAI(base_url=f"{shared_demo.url}/v1", api_key=shared_demo.key, max_retries=0, timeout=120)
    return shared_demo, tmp_path_factory.mktemp("tools-demo"), client


def ask_weather(client, city: str):
    messages = [{"role": "user", "content": f"What's the weather like in {city}?"}]
    reply = client.chat.completions.create(model=ADAPTER, messages=messages, tools=[GET_WEATHER], tool_choice="auto",
                                           temperature=0, max_tokens=64)
    return messages, reply


def test_the_demo_uploads_the_tools_adapter(demo):
    _, _, client = demo
    assert ADAPTER in {m.id for m in client.models.list()}


@pytest.mark.parametrize("city", HELD_OUT)
def test_a_weather_question_gets_one_get_weather_call_for_that_city(demo, city):
    _, _, client = demo
    _, reply = ask_weather(client, city)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert len(choice.message.tool_calls) == 1, choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": city}


def test_round_trip_the_answer_comes_from_the_tool_result(demo):
    _, _, client = demo
    messages, reply = ask_weather(client, "Prague")
    call = reply.choices[0].message.tool_calls[0]
    result = {"city": "Prague", "temperature_c": 9, "condition": "foggy"}
    messages += [reply.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}]
    answer = client.chat.completions.create(model=ADAPTER, messages=messages, tools=[GET_WEATHER], tool_choice="auto",
                                            temperature=0, max_tokens=64).choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls, answer.message
    text = answer.message.content
    assert "9" in text and "foggy" in text.lower(), text


def test_an_unrelated_question_with_tools_offered_is_answered_without_a_call(demo):
    _, _, client = demo
    r = client.chat.completions.create(model=ADAPTER, messages=[{"role": "user", "content": "What is the opposite of push?"}],
                                       tools=[GET_WEATHER], tool_choice="auto", temperature=0, max_tokens=48)
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls, r.choices[0].message
    assert r.choices[0].message.content.strip()


WEATHER_STRICT = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 3}, {"temperature": 1.0, "seed": 11}],
                         ids=["greedy", "sampled-3", "sampled-11"])
def test_the_base_model_forced_to_call_returns_arguments_that_validate(demo, sampling):
    _, _, client = demo
    tools = [{"type": "function", "function": {"name": "get_forecast", "description": "The weather forecast.",
                                               "parameters": WEATHER_STRICT}},
             {"type": "function", "function": {"name": "get_time", "description": "The local time.", "parameters": TIME}}]
    r = client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "Will it rain in Oslo this week?"}],
                                       tools=tools, tool_choice="required", max_tokens=128, **sampling)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls, r.choices[0].message
    schemas = {"get_forecast": WEATHER_STRICT, "get_time": TIME}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_the_printed_tool_round_trip_works_as_pasted(demo):
    d, cwd, _ = demo
    example = next(c for c in printed_commands(d.output) if "<<'EOF'" in c and "tools=tools" in c)
    out = sh(example, cwd)
    call = next(line for line in out.splitlines() if line.startswith("call: "))
    name, _, arguments = call.removeprefix("call: ").partition(" ")
    assert name == "get_weather" and json.loads(arguments) == {"city": "Edinburgh"}, out
    answer = next(line for line in out.splitlines() if line.startswith("answer: "))
    assert "14" in answer and "rainy" in answer.lower(), out
