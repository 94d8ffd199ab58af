"""response_format through the OpenAI-compatible API (the official openai client): JSON that
validates against the request's schema from the base model and the demo adapters, on both
endpoints (the client's completions.create has no response_format argument: it goes in
extra_body, as OpenAI-compatible servers take it), streamed or not; a bad shape or a schema that
cannot be compiled is a 400 naming response_format."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pytest

from adapter_registry import services as registry
from tessera_core.context import build_context

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

BASE = "SmolLM2-135M-Instruct"
DEMO = Path(__file__).resolve().parents[2] / "platform" / "tessera" / "demo_adapters"
DEMO_NAMES = sorted(p.name for p in DEMO.iterdir() if (p / "adapter_config.json").is_file()) if DEMO.is_dir() else []

# Every string, array and number is bounded, so each completion finishes within MAX_TOKENS.
MAX_TOKENS = 120
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 32},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "mood": {"enum": ["happy", "sad", "calm"]}},
        "required": ["name", "age", "mood"], "additionalProperties": False,
    },
    "answer": {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 48},
                       "confident": {"type": "boolean"}},
        "required": ["answer", "confident"], "additionalProperties": False,
    },
    "shopping": {
        "type": "object",
        "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 4,
                                 "items": {"type": "object",
                                           "properties": {"item": {"type": "string", "maxLength": 16},
                                                          "count": {"type": "integer", "minimum": 1, "maximum": 9}},
                                           "required": ["item", "count"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False,
    },
}
QUESTIONS = ["Describe a sailor.", "What is the capital of France?", "What do I need for a cake?",
             "Who painted the Mona Lisa?", "Tell me about a teacher.", "What should I buy for a picnic?",
             "Is the sun a star?", "Describe your best friend.", "What is two plus two?", "List some fruits."]


def fmt(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


@pytest.fixture(scope="module")
def tenant(platform):
    """A tenant with room for 50 concurrent requests, owning the demo adapters."""
    t = platform.tenant(requests_per_minute=100_000, tokens_per_minute=100_000_000, max_concurrent_requests=200)
    ctx = build_context(platform.settings)
    with ctx.session_factory() as s:
        owner = registry.get_tenant(session=s, name=t.name)
        for name in DEMO_NAMES:
            v = registry.upload_adapter(session=s, store=ctx.store, settings=platform.gateway.registry_settings(),
                                        tenant=owner, name=name, source=DEMO / name)
            assert v.status == "ready", v.rejection_reason
    return t


def test_fifty_prompts_validate_against_their_schema(platform, tenant):
    """50 concurrent requests over the base and every demo adapter, both endpoints, greedy and
    sampled, three schemas: every output finishes and validates."""
    client = platform.async_openai(tenant)
    models = [BASE] + DEMO_NAMES
    cases = [(i, models[i % len(models)], list(SCHEMAS)[i % len(SCHEMAS)], QUESTIONS[i % len(QUESTIONS)])
             for i in range(50)]

    async def one(i: int, model: str, schema: str, question: str):
        sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "seed": i}
        if i % 5 == 4:
            r = await client.completions.create(model=model, prompt=f"Question: {question}\nAnswer in JSON: ",
                                                max_tokens=MAX_TOKENS, extra_body={"response_format": fmt(schema)},
                                                **sampling)
            return r.choices[0].text, r.choices[0].finish_reason
        r = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                                 max_tokens=MAX_TOKENS, response_format=fmt(schema), **sampling)
        return r.choices[0].message.content, r.choices[0].finish_reason

    async def run():
        try:
            return await asyncio.gather(*(one(*c) for c in cases))
        finally:
            await client.close()

    results = asyncio.run(run())
    for (i, model, schema, _), (text, reason) in zip(cases, results):
        assert reason == "stop", (i, model, schema, text)
        jsonschema.validate(json.loads(text), SCHEMAS[schema])
    assert {m for _, m, _, _ in cases} == set(models)


def test_streamed_json_object_on_both_endpoints(platform, tenant):
    client = platform.openai(tenant)
    model = DEMO_NAMES[0] if DEMO_NAMES else BASE
    chunks = client.chat.completions.create(model=model, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                            messages=[{"role": "user", "content": "Give me a color as JSON."}],
                                            response_format=fmt("answer"))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMAS["answer"])
    r = client.completions.create(model=BASE, prompt="The capital of Italy as JSON: ", max_tokens=MAX_TOKENS,
                                  temperature=0, extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    else:  # an open-ended object may run out of tokens; what came is still a JSON prefix
        assert r.choices[0].text.startswith("{")


@pytest.mark.parametrize("response_format, param", [
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format"),
    ({"type": "json_schema", "json_schema": {"name": "has space", "schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": {}, "extra": True}},
     "response_format.json_schema.extra"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "strange"}}}, "response_format"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "string", "pattern": "(("}}},
     "response_format"),
])
@pytest.mark.parametrize("endpoint", ["chat", "text"])
def test_bad_response_format_is_a_400_naming_it(platform, tenant, response_format, param, endpoint):
    client = platform.openai(tenant)
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "chat":
            client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                           response_format=response_format)
        else:
            client.completions.create(model=BASE, prompt="Hi", max_tokens=4,
                                      extra_body={"response_format": response_format})
    assert e.value.status_code == 400
    assert e.value.body["param"] == param, e.value.body


def test_a_bad_schema_does_not_disturb_other_tenants(platform, tenant):
    """A refused schema costs its sender a 400 and nothing else: another tenant's constrained
    request in flight at the same time completes and validates."""
    other = platform.tenant()

    async def run():
        good = platform.async_openai(other)
        bad = platform.async_openai(tenant)
        try:
            ok = asyncio.create_task(good.chat.completions.create(
                model=BASE, messages=[{"role": "user", "content": "Describe a sailor."}], max_tokens=MAX_TOKENS,
                temperature=0, response_format=fmt("person")))
            refused = await asyncio.gather(*(bad.chat.completions.create(
                model=BASE, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": f"bad{i}"}}})
                for i in range(8)), return_exceptions=True)
            return await ok, refused
        finally:
            await good.close()
            await bad.close()

    ok, refused = asyncio.run(run())
    assert all(isinstance(e, openai.BadRequestError) for e in refused)
    jsonschema.validate(json.loads(ok.choices[0].message.content), SCHEMAS["person"])
