"""/v1/responses (OpenAI's Responses API) with the official openai client against `tessera demo`
run as a subprocess (its demo tenant owns the demo adapters): plain, streamed and reassembled by
the SDK, instructions, text.format json_schema, a function tool with a forced call then its
output through previous_response_id; stored responses (retrieve, delete, store false, another
tenant's ids are 404 / 400); one usage event per response with the response's token counts;
unsupported fields are a 400 naming them. Storage itself (retention, deleted tenants, chains)
is tested on SQLite and Postgres without a server."""
from __future__ import annotations

import json
import sys
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import openai
import pytest
from sqlalchemy import select, update

from adapter_registry.migrate import upgrade
from adapter_registry.models import Tenant as TenantRow
from adapter_registry.settings import RegistrySettings
from tessera import responses_store
from tessera.models import StoredResponse, UsageEvent
from tessera.responses_store import ChainError, NewResponse
from tessera_core.db import make_engine

from ..adapter_registry.conftest import create_pg_database, drop_pg_database

jsonschema = pytest.importorskip("jsonschema")

TESSERA = Path(sys.executable).parent / "tessera"
BASE = "SmolLM2-135M-Instruct"
ADAPTER = "pirate"
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 40}, "confident": {"type": "boolean"}},
    "required": ["answer", "confident"], "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function", "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False},
    "strict": True,
}


class Served:
    """The session's `tessera demo` (tests/platform/demo_process.py): its URL, the demo tenant's
    key, the admin token, its database."""

    def __init__(self, demo):
        self.url, self.key, self.admin_token = demo.url, demo.key, demo.admin_token
        self.db = make_engine(f"sqlite:///{demo.cwd / 'var' / 'tessera.db'}")

    def client(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key or self.key, max_retries=0, timeout=180)

    def http(self, key: str | None = None) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"authorization": f"Bearer {key or self.key}"}, timeout=180)

    def new_tenant_key(self) -> str:
        """A new tenant (its own plan) and its key."""
        name = "t-" + uuid.uuid4().hex[:10]
        with httpx.Client(base_url=self.url, headers={"authorization": f"Bearer {self.admin_token}"}, timeout=60) as a:
            assert a.put(f"/admin/v1/plans/{name}", json={"requests_per_minute": 600}).status_code == 200
            assert a.post("/admin/v1/tenants", json={"name": name, "plan": name}).status_code == 201
            r = a.post(f"/admin/v1/tenants/{name}/keys", json={"name": "test"})
            assert r.status_code == 201, r.text
            return r.json()["key"]

    def usage_event(self, request_id: str) -> UsageEvent | None:
        with self.db.connect() as c:
            return c.execute(select(UsageEvent).where(UsageEvent.request_id == request_id)).first()


@pytest.fixture(scope="module")
def served(shared_demo):
    s = Served(shared_demo)
    yield s
    s.db.dispose()


def _tools_served() -> bool:
    """Chat tools are there (the Responses API's function tools run on them)."""
    return (Path(__file__).resolve().parents[2] / "platform" / "tessera" / "tool_calls.py").is_file()


# --- plain, streamed, instructions, structured output ------------------------------------------

@pytest.mark.parametrize("model", [BASE, ADAPTER])
def test_plain_response_from_base_and_adapter(served, model):
    r = served.client().responses.create(model=model, input="Which color is a ripe banana?", max_output_tokens=24,
                                         temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == model
    assert r.status in ("completed", "incomplete")
    assert [item.type for item in r.output] == ["message"]
    assert r.output[0].role == "assistant" and r.output[0].content[0].type == "output_text"
    assert r.output_text.strip()
    u = r.usage
    assert u.input_tokens > 0 and 0 < u.output_tokens <= 24 and u.total_tokens == u.input_tokens + u.output_tokens
    assert u.input_tokens_details.cached_tokens >= 0 and u.output_tokens_details.reasoning_tokens == 0
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens" and u.output_tokens == 24


def test_streamed_response_is_reassembled_by_the_sdk(served):
    """The SDK's stream helper rebuilds the response from the events; the deltas add up to its
    text, the sequence numbers count up from 0, the last event is response.completed with usage."""
    fmt = {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA, "strict": True}
    with served.client().responses.stream(model=ADAPTER, input="Is the sun a star?", max_output_tokens=80,
                                          temperature=0, text={"format": fmt}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas and final.output_text == deltas
    jsonschema.validate(json.loads(deltas), ANSWER_SCHEMA)
    assert final.status == "completed" and final.usage.output_tokens > 0
    assert events[-1].response.usage.total_tokens == final.usage.input_tokens + final.usage.output_tokens
    assert final.id.startswith("resp_") and served.client().responses.retrieve(final.id).output_text == deltas


def test_raw_stream_has_openai_event_lines(served):
    """As OpenAI sends it: an `event:` line naming each event's type before its data, no [DONE];
    a stream cut by max_output_tokens ends with response.incomplete."""
    with served.http() as h, h.stream("POST", "/v1/responses", json={
            "model": BASE, "input": "Tell me a long story about a ship.", "max_output_tokens": 6, "stream": True,
            "temperature": 0}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    blocks = [b for b in body.split("\n\n") if b.strip()]
    events = []
    for block in blocks:
        lines = block.split("\n")
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        data = json.loads(lines[1][len("data: "):])
        assert data["type"] == lines[0][len("event: "):]
        events.append(data)
    assert "[DONE]" not in body
    last = events[-1]
    assert last["type"] == "response.incomplete" and last["response"]["status"] == "incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["response"]["usage"]["output_tokens"] == 6
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert last["response"]["output"][0]["content"][0]["text"] == text


def test_instructions_come_first_and_are_echoed(served):
    """`instructions` is the chat request's system message, before the input: the same prompt
    (token for token) as that chat request."""
    client = served.client()
    told = client.responses.create(model=BASE, input="Name a fruit.", instructions="Answer with one word only.",
                                   max_output_tokens=8, temperature=0)
    chat = client.chat.completions.create(model=BASE, max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Answer with one word only."}, {"role": "user", "content": "Name a fruit."}])
    assert told.instructions == "Answer with one word only."
    assert told.usage.input_tokens == chat.usage.prompt_tokens
    plain = client.responses.create(model=BASE, input="Name a fruit.", max_output_tokens=8, temperature=0)
    assert plain.instructions is None and plain.usage.input_tokens != told.usage.input_tokens


@pytest.mark.parametrize("model", [BASE, ADAPTER])
def test_text_format_json_schema_validates(served, model):
    fmt = {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA, "strict": True}
    r = served.client().responses.create(model=model, input="What is the capital of France?", max_output_tokens=80,
                                         temperature=0, text={"format": fmt})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), ANSWER_SCHEMA)
    assert r.text.format.type == "json_schema" and r.text.format.name == "answer"


def test_sdk_parse_with_a_pydantic_model(served):
    from typing import Literal

    from pydantic import BaseModel

    class Verdict(BaseModel):
        wet: bool
        mood: Literal["happy", "sad", "calm"]

    r = served.client().responses.parse(model=ADAPTER, input="Is water wet?", text_format=Verdict,
                                        max_output_tokens=60, temperature=0)
    assert r.status == "completed" and isinstance(r.output_parsed, Verdict)


# --- conversation state ----------------------------------------------------------------------

def test_previous_response_id_continues_the_conversation(served):
    client = served.client()
    first = client.responses.create(model=BASE, input="My name is Ada.", max_output_tokens=12, temperature=0,
                                    instructions="Be brief.")
    second = client.responses.create(model=BASE, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=12, temperature=0)
    alone = client.responses.create(model=BASE, input="What is my name?", max_output_tokens=12, temperature=0)
    assert second.previous_response_id == first.id
    # The first turn's input and output come before the new input (its instructions do not).
    assert second.usage.input_tokens >= alone.usage.input_tokens + first.usage.output_tokens
    third = client.responses.create(model=BASE, input="And again?", previous_response_id=second.id,
                                    max_output_tokens=4, temperature=0)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


def test_stored_responses_retrieve_delete_and_isolation(served):
    owner, other = served.client(), served.client(served.new_tenant_key())
    r = owner.responses.create(model=BASE, input="Say hi.", max_output_tokens=8, temperature=0,
                               metadata={"ticket": "T-1"}, user="end-user-1")
    assert r.store is True and r.metadata == {"ticket": "T-1"}
    got = owner.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()

    # Another tenant: the same 404 as an unknown id, for reading and deleting; its
    # previous_response_id is not found either.
    for call in (lambda: other.responses.retrieve(r.id), lambda: other.responses.delete(r.id),
                 lambda: owner.responses.retrieve("resp_" + "0" * 48)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.BadRequestError) as e:
        other.responses.create(model=BASE, input="hi", previous_response_id=r.id, max_output_tokens=4)
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "previous_response_not_found"
    assert owner.responses.retrieve(r.id).id == r.id  # still there

    owner.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        owner.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        owner.responses.delete(r.id)
    with pytest.raises(openai.BadRequestError):
        owner.responses.create(model=BASE, input="hi", previous_response_id=r.id, max_output_tokens=4)

    unstored = owner.responses.create(model=BASE, input="Say hi.", max_output_tokens=4, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        owner.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError):
        owner.responses.create(model=BASE, input="hi", previous_response_id=unstored.id, max_output_tokens=4)


# --- billing -----------------------------------------------------------------------------------

def test_one_usage_event_per_response_with_its_token_counts(served):
    client = served.client()
    r = client.responses.create(model=ADAPTER, input="Where do pirates sail?", max_output_tokens=16, temperature=0)
    events = list(client.responses.create(model=BASE, input="Count to three.", max_output_tokens=16, temperature=0,
                                          stream=True))
    streamed = events[-1].response
    assert events[-1].type in ("response.completed", "response.incomplete")
    for resp in (r, streamed):
        event = served.usage_event(resp.id)
        assert event is not None, resp.id
        assert event.prompt_tokens == resp.usage.input_tokens
        assert event.completion_tokens == resp.usage.output_tokens
        assert event.cached_tokens == resp.usage.input_tokens_details.cached_tokens
        assert event.status == "completed" and event.model == resp.model
    assert served.usage_event(r.id).adapter_version is not None  # billed as the adapter's request
    with served.db.connect() as c:
        assert len(c.execute(select(UsageEvent).where(UsageEvent.request_id.like(r.id + "%"))).all()) == 1


def test_a_stream_the_client_leaves_is_aborted_and_billed_as_sent(served):
    with served.http() as h, h.stream("POST", "/v1/responses", json={
            "model": BASE, "input": "Write a very long story about the sea.", "max_output_tokens": 400,
            "stream": True}) as r:
        rid = None
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                if data["type"] == "response.created":
                    rid = data["response"]["id"]
                if data["type"] == "response.output_text.delta":
                    break  # the client leaves after its first text
    deadline = time.monotonic() + 30
    while (event := served.usage_event(rid)) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert event is not None and event.status == "aborted" and event.completion_tokens < 400


# --- tools -------------------------------------------------------------------------------------

@pytest.mark.skipif(not _tools_served(), reason="chat tools (tessera.tool_calls) are not there yet")
@pytest.mark.parametrize("model", [BASE, ADAPTER])
def test_forced_function_call_then_its_output(served, model):
    client = served.client()
    r = client.responses.create(model=model, input="What is the weather in Paris?", tools=[WEATHER_TOOL],
                                tool_choice="required", parallel_tool_calls=False, max_output_tokens=200,
                                temperature=0)
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" and c.call_id for c in calls), r.output
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), WEATHER_TOOL["parameters"])
    assert r.tool_choice == "required" and r.tools[0].name == "get_weather"

    answer = client.responses.create(
        model=model, previous_response_id=r.id, tools=[WEATHER_TOOL], max_output_tokens=40, temperature=0,
        input=[{"type": "function_call_output", "call_id": c.call_id, "output": "Sunny, 21 C"} for c in calls])
    assert answer.output[0].type == "message" and answer.output_text.strip()
    assert answer.usage.input_tokens > r.usage.input_tokens  # the call and its result are in the prompt


@pytest.mark.skipif(not _tools_served(), reason="chat tools (tessera.tool_calls) are not there yet")
def test_named_function_call_streamed(served):
    with served.client().responses.stream(model=BASE, input="Weather in Oslo?", tools=[WEATHER_TOOL],
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=200, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert kinds[-1] == "response.completed"
    call = next(item for item in final.output if item.type == "function_call")
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert call.arguments == pieces and call.name == "get_weather"
    jsonschema.validate(json.loads(pieces), WEATHER_TOOL["parameters"])


def test_function_call_history_sent_as_input_items(served):
    """A client that keeps its own history (store false): the call and its output as input items."""
    if not _tools_served():
        pytest.skip("chat tools (tessera.tool_calls) are not there yet")
    r = served.client().responses.create(
        model=BASE, store=False, tools=[WEATHER_TOOL], max_output_tokens=30, temperature=0,
        input=[{"role": "user", "content": "Weather in Rome?"},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Rome"}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "Rainy, 12 C"}])
    assert r.output_text.strip()


# --- refusals ----------------------------------------------------------------------------------

REFUSED = [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[0].type"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "bad name", "parameters": {"type": "object"}}]}, "tools[0].name"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"conversation": "conv_123"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "reasoning", "summary": []}]}, "input[1].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k" * 65: "v"}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata"),
    ({"input": [{"role": "user", "content": "hi"}] * 1025}, "input"),
    ({"text": {"format": {"type": "json_schema", "name": "bad name", "schema": {}}}}, "text.format.name"),
    ({"max_output_tokens": 100_000}, "max_output_tokens"),
    ({"frobnicate": 1}, "frobnicate"),
]


@pytest.mark.parametrize("extra,param", REFUSED, ids=[p for _, p in REFUSED])
def test_unsupported_or_invalid_fields_are_a_400_naming_them(served, extra, param):
    body = {"model": BASE, "input": "hi", "max_output_tokens": 4} | extra
    with served.http() as h:
        r = h.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert param.split("[")[0].split(".")[0] in r.json()["error"]["message"]


def test_sdk_raises_bad_request_for_a_built_in_tool(served):
    with pytest.raises(openai.BadRequestError) as e:
        served.client().responses.create(model=BASE, input="news?", tools=[{"type": "web_search"}])
    assert "web_search" in e.value.message


def test_unknown_model_and_other_tenants_adapter_are_404(served):
    other = served.client(served.new_tenant_key())
    for client, model in ((served.client(), "no-such-model"), (other, ADAPTER)):
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model=model, input="hi", max_output_tokens=4)


# --- translation onto chat, without a server --------------------------------------------------

def test_a_request_translates_to_the_chat_request_that_answers_it():
    from tessera.api.responses import chat_request
    from tessera.api.responses_schema import ResponsesRequest, normalize_input, normalize_tool_choice, normalize_tools

    body = ResponsesRequest(
        model=ADAPTER, instructions="Be brief.", max_output_tokens=50, temperature=0.5, user="u1",
        tools=[WEATHER_TOOL], tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA, "strict": True}},
        input=[{"role": "developer", "content": [{"type": "input_text", "text": "Use metric units."}]},
               {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city":"Rome"}'},
               {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "9 C"}]},
               {"role": "user", "content": "And now?"}])
    history = normalize_input("Weather in Oslo?") + [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "3 C"}]
    chat = chat_request(body, history + normalize_input(body.input), normalize_tools(body.tools),
                        normalize_tool_choice(body.tool_choice))
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]

    def call(i: int, city: str) -> dict:
        return {"id": f"call_{i}", "type": "function",
                "function": {"name": "get_weather", "arguments": f'{{"city":"{city}"}}'}}

    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call(1, "Oslo")]},
        {"role": "tool", "content": "3 C", "tool_call_id": "call_1"},
        {"role": "developer", "content": "Use metric units."},
        {"role": "assistant", "tool_calls": [call(2, "Rome")]},
        {"role": "tool", "content": "9 C", "tool_call_id": "call_2"},
        {"role": "user", "content": "And now?"}]
    assert chat.n == 1 and chat.max_completion_tokens == 50 and chat.temperature == 0.5 and chat.user == "u1"
    assert chat.tools == [{"type": "function", "function": {k: v for k, v in WEATHER_TOOL.items() if k != "type"}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.parallel_tool_calls is False
    fmt = chat.response_format.model_dump(by_alias=True, exclude_none=True)
    assert fmt == {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}


# --- storage, without a server: SQLite and Postgres --------------------------------------------

@pytest.fixture(params=["sqlite", "postgres"])
def db(request, tmp_path):
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'r.db'}"
    else:
        url = create_pg_database()
    upgrade(RegistrySettings(_env_file=None, database_url=url))
    engine = make_engine(url)
    yield engine
    engine.dispose()
    if request.param == "postgres":
        drop_pg_database(url)


def _tenant(session, name: str) -> int:
    t = TenantRow(name=name)
    session.add(t)
    session.commit()
    return t.id


def _row(tenant_id: int, rid: str, *, previous: str | None = None, age_days: float = 0) -> NewResponse:
    return NewResponse(id=rid, tenant_id=tenant_id, api_key_id=None, model=BASE, status="completed",
                       created_at=datetime.now(timezone.utc) - timedelta(days=age_days), previous_response_id=previous,
                       instructions=None, metadata={},
                       input_items=[{"type": "message", "role": "user",
                                     "content": [{"type": "input_text", "text": rid}]}],
                       output_items=[{"type": "message", "role": "assistant",
                                      "content": [{"type": "output_text", "text": "re " + rid}]}],
                       usage=None, params={})


def test_store_isolation_retention_and_tenant_deletion(db):
    from sqlalchemy.orm import sessionmaker

    Session = sessionmaker(db)
    with Session() as s:
        a, b = _tenant(s, "a"), _tenant(s, "b")
        for r in (_row(a, "resp_old", age_days=31), _row(a, "resp_a1"), _row(a, "resp_a2", previous="resp_a1"),
                  _row(b, "resp_b1")):
            responses_store.save(session=s, response=r, retention_days=60)

        def get(tenant, rid, days=30):
            return responses_store.get(session=s, tenant_id=tenant, response_id=rid, retention_days=days)

        assert get(a, "resp_a1") is not None and get(b, "resp_a1") is None  # isolation
        assert get(a, "resp_old") is None and get(a, "resp_old", 60) is not None  # past retention: not found
        # The chain, oldest first, input then output of each.
        texts = [p["text"] for item in responses_store.history(session=s, tenant_id=a, response_id="resp_a2",
                                                               retention_days=30) for p in item["content"]]
        assert texts == ["resp_a1", "re resp_a1", "resp_a2", "re resp_a2"]
        with pytest.raises(ChainError) as e:
            responses_store.history(session=s, tenant_id=b, response_id="resp_a2", retention_days=30)
        assert e.value.code == "previous_response_not_found"
        with pytest.raises(ChainError) as e:
            responses_store.history(session=s, tenant_id=a, response_id="resp_a2", retention_days=30, max_chain=1)
        assert e.value.code == "conversation_too_long"
        assert not responses_store.remove(session=s, tenant_id=b, response_id="resp_a1", retention_days=30)
        assert responses_store.remove(session=s, tenant_id=a, response_id="resp_a1", retention_days=30)
        with pytest.raises(ChainError):  # a broken chain is refused, not silently cut
            responses_store.history(session=s, tenant_id=a, response_id="resp_a2", retention_days=30)

        # Retention: a save purges rows past it; purge_expired also takes deleted tenants' rows.
        responses_store.save(session=s, response=_row(b, "resp_b2"), retention_days=30)
        assert s.scalar(select(StoredResponse).where(StoredResponse.id == "resp_old")) is None
        s.execute(update(TenantRow).where(TenantRow.id == b).values(deleted_at=datetime.now(timezone.utc)))
        s.commit()
        assert responses_store.purge_expired(session=s, retention_days=30) == 2
        s.commit()
        assert set(s.scalars(select(StoredResponse.id))) == {"resp_a2"}

        # A tenant row deleted outright takes its responses with it (ON DELETE CASCADE).
        s.execute(TenantRow.__table__.delete().where(TenantRow.id == a))
        s.commit()
        assert list(s.scalars(select(StoredResponse.id))) == []


def test_retention_setting_is_read_from_the_environment(monkeypatch):
    from tessera.settings import PlatformSettings

    monkeypatch.setenv("TESSERA_RESPONSES_RETENTION_DAYS", "7")
    assert PlatformSettings(_env_file=None).responses_retention_days == 7
    assert PlatformSettings(_env_file=None, responses_retention_days=30).responses_retention_days == 30


# --- the stream's events from chat chunks, without an engine -----------------------------------

def _events_of(monkeypatch, chunks: list[dict]) -> list[dict]:
    """The Responses events `_stream` makes of these chat chunks (store false: no database)."""
    import asyncio

    from tessera.api import responses as api
    from tessera.api.responses_schema import ResponsesRequest

    async def stream_chat(_gen):
        for c in chunks:
            yield c

    monkeypatch.setattr(api.generation, "stream_chat", stream_chat)
    body = ResponsesRequest(model=BASE, input="hi", store=False)
    answer = api.Answer(id="resp_test", created_at=1, body=body, caller=None, input_items=[],
                        params=api._params(body, [], None))

    async def run() -> bytes:
        return b"".join([part async for part in api._stream(None, None, answer)])

    events = []
    for block in asyncio.run(run()).decode().split("\n\n"):
        if block.strip():
            kind, data = block.split("\n")
            events.append(json.loads(data.removeprefix("data: ")))
            assert kind == "event: " + events[-1]["type"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def _chunk(delta: dict, finish: str | None = None) -> dict:
    return {"id": "resp_test", "object": "chat.completion.chunk", "created": 1, "model": BASE,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], "usage": None}


USAGE = {"id": "resp_test", "object": "chat.completion.chunk", "created": 1, "model": BASE, "choices": [],
         "usage": {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16,
                   "prompt_tokens_details": {"cached_tokens": 4}}}


def test_text_then_two_tool_calls_become_three_output_items(monkeypatch):
    events = _events_of(monkeypatch, [
        _chunk({"role": "assistant", "content": ""}), _chunk({"content": "Let me check."}),
        _chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                "function": {"name": "get_weather", "arguments": ""}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]}),
        _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}),
        _chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                                "function": {"name": "get_weather", "arguments": ""}}]}),
        _chunk({"tool_calls": [{"index": 1, "function": {"arguments": '{"city":"Rome"}'}}]}),
        _chunk({}, "tool_calls"), USAGE])
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["store"] is False
    assert [(o["type"], o.get("call_id"), o.get("arguments")) for o in final["output"]] == [
        ("message", None, None), ("function_call", "call_a", '{"city":"Oslo"}'),
        ("function_call", "call_b", '{"city":"Rome"}')]
    assert final["output"][0]["content"][0]["text"] == "Let me check."
    assert final["usage"] == {"input_tokens": 9, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 7,
                              "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 16}
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]


def test_an_engine_failure_mid_stream_ends_with_error_and_response_failed(monkeypatch):
    error = {"error": {"message": "the engine failed mid-request; try again", "type": "server_error", "param": None,
                       "code": "engine_unavailable"}}
    events = _events_of(monkeypatch, [_chunk({"role": "assistant", "content": ""}), _chunk({"content": "Hel"}), error])
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-2]["code"] == "engine_unavailable"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "engine_unavailable"
    assert failed["output"][0]["status"] == "incomplete" and failed["output"][0]["content"][0]["text"] == "Hel"


def test_an_empty_reply_is_one_empty_message(monkeypatch):
    events = _events_of(monkeypatch, [_chunk({"role": "assistant", "content": ""}), _chunk({}, "stop"), USAGE])
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["message"] and final["output"][0]["content"][0]["text"] == ""
