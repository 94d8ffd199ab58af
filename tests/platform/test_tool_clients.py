"""The agent frameworks people point at OpenAI-compatible servers, against Tessera's tools (issue
31): LangChain's ChatOpenAI (`bind_tools`, `.stream()` whose tool_call_chunks merge into a call, an
agent that runs a real Python tool and answers from its result, `with_structured_output(...,
method="function_calling")`), LiteLLM (a call parsed into its response object, and streamed then
rebuilt by `stream_chunk_builder`) and instructor in its default TOOLS mode (a validated instance,
and streamed partials).

Each runs against `tessera demo` started as a subprocess, as `make run` starts it, once with the
demo tools adapter `weather-tools` (trained to call get_weather for a weather question and to
answer from the result: it is asked with tool_choice "auto") and once with the base model
(SmolLM2-135M-Instruct, never taught tools: it is asked with a forced choice, which a grammar
enforces). The session's one demo process (conftest.py: shared_demo).
"""
from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field


BASE = "SmolLM2-135M-Instruct"
ADAPTER = "weather-tools"
ASK = "What's the weather like in Lisbon?"
#: The tool as `weather-tools` was trained with it (scripts/train_demo_adapters.py: GET_WEATHER).
GET_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PARAMETERS = GET_WEATHER["function"]["parameters"]
#: What the real tool returns (a condition and a temperature the answer has to copy).
RESULT = {"temperature_c": 17, "condition": "cloudy"}
#: The framework clients' environment: no cost map, telemetry or tracing fetched from outside
#: (the test machine reaches localhost only), and no .env read into this process (LiteLLM's
#: default "DEV" mode loads one at import, which would reach the TESSERA_ settings of later tests).
OFFLINE = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False", "LITELLM_MODE": "PRODUCTION",
           "LANGSMITH_TRACING": "false", "LANGCHAIN_TRACING_V2": "false"}


class Weather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=40)
    temperature_c: int = Field(ge=-60, le=60)
    condition: Literal["sunny", "cloudy", "rainy", "snowy"]


@pytest.fixture(scope="module")
def server(shared_demo):
    """(url, key, models) of the session's `tessera demo` subprocess, read off what it printed;
    the clients run under OFFLINE while the module's tests run."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in OFFLINE.items():
            mp.setenv(k, v)
        client = openai.OpenAI(base_url=f"{shared_demo.url}/v1", api_key=shared_demo.key, max_retries=0, timeout=120)
        models = {m.id for m in client.models.list()}
        yield f"{shared_demo.url}/v1", shared_demo.key, models


def served(server, model: str) -> str:
    """`model`, or a skip when the demo did not upload it (weather-tools ships once trained)."""
    if model not in server[2]:
        pytest.skip(f"{model} is not served: platform/tessera/demo_adapters/{model}/ is not there yet (scripts/"
                    "train_demo_adapters.py --only weather-tools trains it), so tessera demo did not upload it")
    return model


def weather_tool(ran: list[str]):
    """The real Python tool the frameworks convert and run; each call's city goes into `ran`."""
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        ran.append(city)
        return json.dumps({"city": city, **RESULT})
    return get_weather


def assert_weather_call(name: str, args: dict, model: str) -> None:
    """A get_weather call whose arguments validate; the adapter, trained for it, names Lisbon."""
    assert name == "get_weather"
    jsonschema.validate(args, PARAMETERS)
    if model == ADAPTER:
        assert args == {"city": "Lisbon"}, args


# -- LangChain ----------------------------------------------------------------------------------

@pytest.fixture
def chat_openai(server):
    from langchain_openai import ChatOpenAI

    url, key, _ = server

    def make(model: str, max_tokens: int = 100):
        return ChatOpenAI(model=served(server, model), base_url=url, api_key=key, temperature=0,
                          max_tokens=max_tokens, max_retries=0, timeout=120)
    return make


@pytest.mark.parametrize("model, choice", [(ADAPTER, "auto"), (ADAPTER, "get_weather"), (ADAPTER, "any"),
                                           (BASE, "get_weather"), (BASE, "any")])
def test_langchain_bind_tools_returns_an_aimessage_with_a_valid_call(chat_openai, model, choice):
    from langchain_core.messages import AIMessage

    llm = chat_openai(model).bind_tools([weather_tool([])], tool_choice=choice)
    message = llm.invoke(ASK)
    assert isinstance(message, AIMessage) and not message.invalid_tool_calls, message
    assert len(message.tool_calls) == 1, message
    call = message.tool_calls[0]
    assert call["id"].startswith("call_") and call["type"] == "tool_call"
    assert_weather_call(call["name"], call["args"], model)


@pytest.mark.parametrize("model, choice", [(ADAPTER, "auto"), (BASE, "any")])
def test_langchain_streamed_tool_call_chunks_merge_into_the_call(chat_openai, model, choice):
    llm = chat_openai(model).bind_tools([weather_tool([])], tool_choice=choice)
    chunks = list(llm.stream(ASK))
    assert any(c.tool_call_chunks for c in chunks), chunks
    merged = chunks[0]
    for c in chunks[1:]:
        merged += c
    assert not merged.invalid_tool_calls and len(merged.tool_calls) == 1, merged
    assert merged.tool_calls[0]["id"].startswith("call_")
    assert_weather_call(merged.tool_calls[0]["name"], merged.tool_calls[0]["args"], model)
    assert merged.response_metadata["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("model", [ADAPTER, BASE])
def test_langchain_agent_runs_the_tool_and_answers_from_its_result(chat_openai, model):
    from langchain.agents import create_agent
    from langchain.agents.middleware import wrap_model_call
    from langchain_core.messages import AIMessage, ToolMessage

    @wrap_model_call
    def call_then_answer(request, handler):
        """The base model does not choose tools: its first step is forced to call one, the next
        to answer (the adapter chooses both by itself)."""
        called = any(isinstance(m, ToolMessage) for m in request.messages)
        return handler(request.override(tool_choice="none" if called else "any"))

    ran: list[str] = []
    agent = create_agent(chat_openai(model, max_tokens=120), [weather_tool(ran)],
                         middleware=[call_then_answer] if model == BASE else [])
    messages = agent.invoke({"messages": [("user", ASK)]}, {"recursion_limit": 6})["messages"]
    calls = [c for m in messages if isinstance(m, AIMessage) for c in m.tool_calls]
    assert len(calls) == 1 and len(ran) == 1, messages  # the real function ran, once
    assert_weather_call(calls[0]["name"], calls[0]["args"], model)
    result = next(m for m in messages if isinstance(m, ToolMessage))
    assert result.tool_call_id == calls[0]["id"] and json.loads(result.content)["condition"] == "cloudy"
    answer = messages[-1]
    assert isinstance(answer, AIMessage) and not answer.tool_calls and answer.content.strip(), messages
    if model == ADAPTER:  # trained to answer from the result
        assert "17" in answer.content and "cloudy" in answer.content.lower(), answer.content


@pytest.mark.parametrize("model", [ADAPTER, BASE])
def test_langchain_structured_output_by_function_calling_is_a_validated_instance(chat_openai, model):
    structured = chat_openai(model).with_structured_output(Weather, method="function_calling")
    got = structured.invoke(ASK)
    assert isinstance(got, Weather), got
    streamed = list(structured.stream(ASK))
    assert streamed and isinstance(streamed[-1], Weather), streamed
    assert streamed[-1] == got  # temperature 0: the stream says what the whole reply said


# -- LiteLLM ------------------------------------------------------------------------------------

@pytest.fixture
def litellm_completion(server):
    import litellm  # after `server` has set OFFLINE: the cost map is read at import

    litellm.suppress_debug_info = True
    url, key, _ = server

    def completion(model: str, **kw):
        return litellm.completion(model=f"openai/{served(server, model)}", api_base=url, api_key=key,
                                  messages=[{"role": "user", "content": ASK}], tools=[GET_WEATHER], max_tokens=100,
                                  temperature=0, timeout=120, **kw)
    return litellm, completion


def assert_litellm_call(message, model: str) -> None:
    assert message.tool_calls and len(message.tool_calls) == 1, message
    call = message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert_weather_call(call.function.name, json.loads(call.function.arguments), model)


@pytest.mark.parametrize("model, choice", [(ADAPTER, "auto"), (BASE, "required"),
                                           (BASE, {"type": "function", "function": {"name": "get_weather"}})],
                         ids=[f"{ADAPTER}-auto", f"{BASE}-required", f"{BASE}-named"])
def test_litellm_parses_the_call_into_its_response_object(litellm_completion, model, choice):
    litellm, completion = litellm_completion
    r = completion(model, tool_choice=choice)
    assert isinstance(r, litellm.ModelResponse)
    assert r.choices[0].finish_reason == "tool_calls"  # LiteLLM's for any reply with calls (a named one too)
    assert_litellm_call(r.choices[0].message, model)
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0


@pytest.mark.parametrize("model, choice", [(ADAPTER, "auto"), (BASE, "required")])
def test_litellm_streamed_call_is_rebuilt_by_stream_chunk_builder(litellm_completion, model, choice):
    litellm, completion = litellm_completion
    chunks = list(completion(model, tool_choice=choice, stream=True, stream_options={"include_usage": True}))
    whole = completion(model, tool_choice=choice)
    rebuilt = litellm.stream_chunk_builder(chunks, messages=[{"role": "user", "content": ASK}])
    assert isinstance(rebuilt, litellm.ModelResponse)
    assert rebuilt.choices[0].finish_reason == "tool_calls"
    assert_litellm_call(rebuilt.choices[0].message, model)
    assert rebuilt.choices[0].message.tool_calls[0].function.arguments == \
        whole.choices[0].message.tool_calls[0].function.arguments
    # The server's usage, not a local count: the prompt holds the tools.
    assert (rebuilt.usage.prompt_tokens, rebuilt.usage.completion_tokens) == \
        (whole.usage.prompt_tokens, whole.usage.completion_tokens)


# -- instructor ---------------------------------------------------------------------------------

@pytest.fixture
def instructor_client(server):
    import instructor

    url, key, _ = server
    client = instructor.from_openai(openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=120))
    assert client.mode == instructor.Mode.TOOLS  # the default
    return client


@pytest.mark.parametrize("model", [ADAPTER, BASE])
def test_instructor_tools_mode_returns_a_validated_instance(server, instructor_client, model):
    # instructor sends the model's pydantic schema as it is, without "additionalProperties": false
    # (pydantic's default): the forced call must still end with the declared properties rather
    # than run on with made-up ones until max_tokens (finish_reason "length": an instructor error).
    got, completion = instructor_client.chat.completions.create_with_completion(
        model=served(server, model), response_model=Weather, messages=[{"role": "user", "content": ASK}],
        max_tokens=100, temperature=0)
    assert isinstance(got, Weather), got
    calls = completion.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["Weather"]  # a named call: the grammar forced it
    assert completion.choices[0].finish_reason == "stop"  # as OpenAI ends a named call


@pytest.mark.parametrize("model", [ADAPTER, BASE])
def test_instructor_streamed_partials_end_in_the_validated_instance(server, instructor_client, model):
    partials = list(instructor_client.chat.completions.create_partial(
        model=served(server, model), response_model=Weather, messages=[{"role": "user", "content": ASK}],
        max_tokens=100, temperature=0))
    assert len(partials) > 1, partials  # the arguments arrived in pieces
    assert Weather.model_validate(partials[-1].model_dump()), partials[-1]
