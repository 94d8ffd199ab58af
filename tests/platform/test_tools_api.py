"""Tool calling through the public API with the official openai client (issue 31): forced calls
(`required`, a named function) always parse and validate against the tool's schema, on the base
model and on adapters, alone and 50 at once; streamed calls reassemble into the same shape;
histories with calls and tool results are rendered; bad tools are 400s naming the field."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest

from .conftest import Platform, ServerThread
from .test_gateway_http_engine import gateway_for, worker  # noqa: F401 - the worker fixture
from .test_gateway_isolation import upload

BASE = "SmolLM2-135M-Instruct"
DEMO = Path(__file__).resolve().parents[2] / "platform" / "tessera" / "demo_adapters"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
CONVERT = {"type": "function", "function": {
    "name": "convert_currency", "description": "Convert an amount between currencies.",
    "parameters": {"type": "object", "properties": {
        "amount": {"type": "integer", "minimum": 0, "maximum": 1000000000}, "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "to": {"type": "string", "pattern": "^[A-Z]{3}$"}},
        "required": ["amount", "from", "to"], "additionalProperties": False}}}
TOOLS = [WEATHER, CONVERT]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What's the weather like in Lisbon today?"}]


@pytest.fixture(scope="module")
def tenant(platform):
    t = platform.tenant()
    for name in ("pirate", "upper"):
        if (DEMO / name).is_dir():
            upload(platform, t.name, name, DEMO / name)
    return t


def _valid_calls(calls, names=None) -> None:
    assert calls, "no tool call"
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        assert names is None or c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def test_required_forces_a_valid_call_on_the_base_model(platform, tenant):
    r = platform.openai(tenant).chat.completions.create(
        model=BASE, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    _valid_calls(choice.message.tool_calls)
    assert r.usage.completion_tokens > 0


def test_a_named_function_is_the_one_called(platform, tenant):
    r = platform.openai(tenant).chat.completions.create(
        model=BASE, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0.7, seed=5,
        tool_choice={"type": "function", "function": {"name": "convert_currency"}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop"  # as OpenAI: a forced named call ends as "stop"
    assert [c.function.name for c in choice.message.tool_calls] == ["convert_currency"]
    _valid_calls(choice.message.tool_calls)


def test_tool_choice_none_and_auto_answer_in_text_when_no_call_is_made(platform, tenant):
    client = platform.openai(tenant)
    r = client.chat.completions.create(model=BASE, messages=ASK, tools=TOOLS, tool_choice="none",
                                       max_tokens=12, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    r = client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "Say hi."}], tools=TOOLS,
                                       max_tokens=12, temperature=0)
    message = r.choices[0].message
    assert message.content or message.tool_calls  # auto: the model chooses; either is an answer


def test_streamed_calls_arrive_in_openais_shape_and_reassemble(platform, tenant):
    stream = platform.openai(tenant).chat.completions.create(
        model=BASE, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0, stream=True,
        stream_options={"include_usage": True})
    calls: dict[int, dict] = {}
    finish, usage, content = None, None, ""
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or ():
                if d.id is not None:  # a call starts: id, type and name first, empty arguments
                    assert d.index not in calls and d.type == "function" and d.function.name
                    assert d.function.arguments == ""
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    calls[d.index]["arguments"] += d.function.arguments
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert sorted(calls) == list(range(len(calls))) and calls
    for c in calls.values():
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])
    assert usage.completion_tokens > 0

    # The SDK's own stream helper reassembles the same calls.
    with platform.openai(tenant).chat.completions.stream(
            model=BASE, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0) as s:
        final = s.get_final_completion()
    got = final.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got] == \
        [(c["name"], json.loads(c["arguments"])) for c in calls.values()]


def test_a_round_trip_with_parallel_calls_and_tool_results_in_the_history(platform, tenant):
    client = platform.openai(tenant)
    first = client.chat.completions.create(model=BASE, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=120, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    # The assistant message goes back as the SDK returned it, with a second (parallel) call.
    assistant = first.choices[0].message.model_dump(exclude_none=True)
    assistant["tool_calls"].append({"id": "call_two", "type": "function", "function": {
        "name": "convert_currency", "arguments": '{"amount": 10, "from": "EUR", "to": "USD"}'}})
    history = ASK + [assistant,
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21, "sky": "clear"}'},
                     {"role": "tool", "tool_call_id": "call_two", "content": '{"amount": 10.8, "currency": "USD"}'}]
    r = client.chat.completions.create(model=BASE, messages=history, tools=TOOLS, tool_choice="none",
                                       max_tokens=24, temperature=0)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None
    # The tool results are in the prompt: it is longer than the history without them.
    shorter = client.chat.completions.create(model=BASE, messages=ASK + [assistant], tools=TOOLS,
                                             tool_choice="none", max_tokens=1)
    assert r.usage.prompt_tokens > shorter.usage.prompt_tokens + 20


def test_fifty_concurrent_forced_calls_on_base_and_adapters_all_validate(platform, tenant):
    client = platform.openai(tenant)
    models = [BASE] + [n for n in ("pirate", "upper") if (DEMO / n).is_dir()]
    cities = ["Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi"]

    def one(i: int):
        choice = "required" if i % 2 else {"type": "function", "function": {"name": "get_weather"}}
        msgs = [{"role": "user", "content": f"How warm is it in {cities[i % len(cities)]}?"}]
        r = client.chat.completions.create(model=models[i % len(models)], messages=msgs, tools=TOOLS,
                                           tool_choice=choice, max_tokens=120, temperature=0.8, seed=i)
        return i, r

    with ThreadPoolExecutor(50) as pool:
        results = list(pool.map(one, range(50)))
    for i, r in results:
        names = None if i % 2 else {"get_weather"}
        assert r.choices[0].message.tool_calls, (models[i % len(models)], r.choices[0])
        _valid_calls(r.choices[0].message.tool_calls, names)
    events = {e.request_id: e for e in platform.usage_events(tenant.name)}
    for _, r in results:  # billed as any chat request: the call's tokens are completion tokens
        assert events[r.id].completion_tokens == r.usage.completion_tokens
        assert events[r.id].prompt_tokens == r.usage.prompt_tokens


@pytest.mark.parametrize("kw, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!", "parameters": {}}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch_rockets"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tools_are_a_400_naming_the_field(platform, tenant, kw, param):
    client = platform.openai(tenant)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=BASE, messages=ASK, max_tokens=2, **kw)
    assert e.value.body["param"] == param


def test_schemas_beyond_the_bounds_and_tools_on_completions_are_refused(platform, tenant):
    client = platform.openai(tenant)
    deep: dict = {"type": "object"}
    node = deep
    for _ in range(40):
        node["properties"] = {"x": {"type": "object"}}
        node = node["properties"]["x"]
    for tools in ([{"type": "function", "function": {"name": "deep", "parameters": deep}}],
                  [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=BASE, messages=ASK, max_tokens=2, tools=tools)
        assert e.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=BASE, prompt="hi", max_tokens=2, extra_body={"tools": TOOLS})
    assert e.value.body["param"] == "tools"


def test_a_tool_message_without_its_call_id_is_a_400(platform, tenant):
    with pytest.raises(openai.BadRequestError) as e:
        platform.openai(tenant).chat.completions.create(
            model=BASE, max_tokens=2, messages=ASK + [{"role": "tool", "content": "21C"}])
    assert "tool_call_id" in e.value.body["message"]


def test_a_forced_call_through_an_engine_worker(platform, tenant, worker):  # noqa: F811
    """The scale-out form: the call's grammar crosses the worker protocol in the sampling params."""
    app, settings = gateway_for(platform, [worker.url])
    with ServerThread(app) as server:
        client = Platform(server.url, settings, app).openai(tenant)
        r = client.chat.completions.create(model=BASE, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
        chunks = list(client.chat.completions.create(model=BASE, messages=ASK, tools=TOOLS, max_tokens=120,
                                                     temperature=0, tool_choice="required", stream=True))
    _valid_calls(r.choices[0].message.tool_calls, {"get_weather"})
    assert any(d.function.name for c in chunks for ch in c.choices for d in ch.delta.tool_calls or ())
