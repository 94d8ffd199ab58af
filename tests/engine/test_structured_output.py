"""Structured output in the engine: response_format constrains a request's tokens (greedy and
sampled, base and adapters) while the unconstrained requests of the same batch come out as they
would alone; schemas the library cannot compile are refused naming response_format; compiled
grammars are cached."""
from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path

import pytest

from engine.async_engine import AsyncLLMEngine
from engine.lora.source import LocalDirectoryAdapterSource
from engine.response_format import MAX_SCHEMA_BYTES
from engine.sampling_params import GenerationRequest, InvalidRequestError, SamplingParams
from engine.structured_output import GrammarRejected, StructuredOutput

from .conftest import chat

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

DEMO = Path(__file__).resolve().parents[2] / "platform" / "tessera" / "demo_adapters"
DEMO_NAMES = sorted(p.name for p in DEMO.iterdir() if (p / "adapter_config.json").is_file()) if DEMO.is_dir() else []

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {"type": "array", "items": {"type": "string", "enum": ["en", "fr", "de"]}, "maxItems": 3},
        "mood": {"enum": ["happy", "sad", "calm"]},
    },
    "required": ["name", "age", "languages", "mood"],
    "additionalProperties": False,
}


def schema_format(schema: dict, name: str = "person") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def req(rid: str, tokenizer, text: str, *, adapter=None, **params) -> GenerationRequest:
    return GenerationRequest(rid, prompt=chat(tokenizer, text), adapter=adapter, params=SamplingParams(**params))


def test_json_schema_greedy_and_sampled_outputs_validate(engine, tokenizer):
    fmt = schema_format(PERSON)
    reqs = [req("greedy", tokenizer, "Describe a French teacher.", max_tokens=80, temperature=0, response_format=fmt)]
    reqs += [req(f"sampled{i}", tokenizer, "Describe someone.", max_tokens=80, temperature=1.0, seed=i,
                 response_format=fmt) for i in range(3)]
    outs = engine.generate(reqs)
    for out in outs.values():
        assert out.finish_reason == "stop", (out.request_id, out.text)
        jsonschema.validate(json.loads(out.text), PERSON)


def test_json_object_output_is_one_json_object(engine, tokenizer):
    out = engine.generate([req("obj", tokenizer, "Give the capital of Italy as JSON.", max_tokens=64, temperature=0,
                               response_format={"type": "json_object"})])["obj"]
    assert out.finish_reason == "stop"
    assert isinstance(json.loads(out.text), dict)


def test_response_format_text_is_unconstrained(engine, tokenizer):
    plain = req("plain", tokenizer, "Name a color.", max_tokens=8, temperature=0)
    text = req("text", tokenizer, "Name a color.", max_tokens=8, temperature=0, response_format={"type": "text"})
    assert text.params.response_format is None
    outs = engine.generate([plain, text])
    assert outs["text"].token_ids == outs["plain"].token_ids


@pytest.fixture(scope="module")
def lora_engine(make_engine, tmp_path_factory):
    if not DEMO_NAMES:
        pytest.skip("demo adapters are not there")
    root = tmp_path_factory.mktemp("adapters")
    for name in DEMO_NAMES:
        shutil.copytree(DEMO / name, root / name)
    return make_engine(LocalDirectoryAdapterSource(root), max_loras=4, max_lora_rank=16)


def test_mixed_batch_constrains_only_its_rows(lora_engine, tokenizer):
    """Constrained and free requests, base and adapters, greedy and sampled, in one batch: the
    free ones get exactly the tokens they get alone, the constrained ones validate."""
    fmt = schema_format(PERSON)
    adapters = [None] + DEMO_NAMES
    free = [req(f"free-{a}", tokenizer, "Tell me about the sea.", adapter=a, max_tokens=12, temperature=0.8, seed=7)
            for a in adapters]
    alone = lora_engine.generate(free)
    again = [req(f"free-{a}", tokenizer, "Tell me about the sea.", adapter=a, max_tokens=12, temperature=0.8, seed=7)
             for a in adapters]
    constrained = [req(f"json-{a}-{t}", tokenizer, "Describe a sailor.", adapter=a, max_tokens=80, temperature=t,
                       seed=3, response_format=fmt) for a in adapters for t in (0.0, 1.0)]
    mixed = lora_engine.generate(again + constrained)
    for r in again:
        assert mixed[r.request_id].token_ids == alone[r.request_id].token_ids, r.request_id
    for r in constrained:
        out = mixed[r.request_id]
        assert out.finish_reason == "stop", (r.request_id, out.text)
        jsonschema.validate(json.loads(out.text), PERSON)
    assert not lora_engine.structured.active  # every matcher released with its request


@pytest.mark.parametrize("schema, reason", [
    ({"type": "strange"}, "strange"),
    ({"type": "string", "pattern": "(("}, "regex"),
    ({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, "nowhere"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength"),
])
def test_schema_the_library_cannot_compile_is_refused(engine, tokenizer, schema, reason):
    r = req("bad", tokenizer, "Hi", max_tokens=4, response_format=schema_format(schema))
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request(r)
    assert e.value.param == "response_format"
    assert reason in e.value.message
    assert "bad" not in engine.requests and not engine.has_unfinished()


@pytest.mark.parametrize("response_format, param, reason", [
    (schema_format({"$ref": "#"}), "response_format", "allows no output"),
    (schema_format({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}), "response_format",
     "Too many items"),
    (schema_format({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1000)}}),
     "response_format", "row has"),
    (schema_format({"type": "object", "properties": {"a": {"type": "string", "pattern": "^(.{1,100}){1,100}$"}},
                    "required": ["a"]}), "response_format", "too many expressions"),
    # A tool-call grammar: its fixed opening is forced, then the embedded schema fails.
    ({"type": "lark", "lark": 'start: "<call>" body\nbody: %json {"$ref": "#"}'}, "tools", "allows no output"),
])
def test_grammars_that_compile_but_cannot_be_served_are_refused(tokenizer, response_format, param, reason):
    so = StructuredOutput(tokenizer, tokenizer.vocab_size, {tokenizer.eos_token_id})
    with pytest.raises(InvalidRequestError) as e:
        so.compile(SamplingParams.from_dict({"response_format": response_format}).response_format)
    assert e.value.param == param and "cannot be served" in e.value.message and reason in e.value.message
    assert so.cached() == 0


def test_a_grammar_failing_mid_generation_ends_only_its_request_as_the_clients_error(engine, tokenizer):
    """The schema's first tokens are served (a free 16-character string the compile probe does
    not walk to its end), then the second property's pattern exhausts the library's lexer: that
    request ends with finish "error" naming response_format, no fault is counted, and the
    unconstrained request beside it comes out as it would alone."""
    from prometheus_client import REGISTRY

    late = {"type": "object", "properties": {"s": {"type": "string", "minLength": 16, "maxLength": 16},
                                             "r": {"type": "string", "pattern": "^(.{1,100}){1,100}$"}},
            "required": ["s", "r"], "additionalProperties": False}
    free = req("free", tokenizer, "Count to ten.", max_tokens=32, temperature=0)
    alone = engine.generate([free])["free"]

    def faults():
        return sum(s.value for m in REGISTRY.collect() if m.name == "tessera_engine_request_faults"
                   for s in m.samples if s.name.endswith("_total"))

    before = faults()
    refused = REGISTRY.get_sample_value("tessera_engine_grammar_refusals_total") or 0.0
    outs = engine.generate([free, req("late", tokenizer, "Hi", max_tokens=48, temperature=0,
                                      response_format=schema_format(late))])
    out = outs["late"]
    assert (out.finish_reason, out.invalid_param) == ("error", "response_format"), out
    assert "too many expressions" in out.error and out.text.startswith('{"s": "') and '"r": "' in out.text
    assert outs["free"].token_ids == alone.token_ids
    assert faults() == before
    assert REGISTRY.get_sample_value("tessera_engine_grammar_refusals_total") == refused + 1
    assert not engine.structured.active and not engine.has_unfinished()


@pytest.mark.parametrize("value, part", [
    ({"type": "xml"}, "type must be one of"),
    ({"type": "json_schema"}, "json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"name": "has space", "schema": {}}}, "json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": {}, "extra": 1}}, "unknown field 'extra'"),
    ({"type": "json_object", "json_schema": {}}, "unknown field 'json_schema'"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"description": "x" * MAX_SCHEMA_BYTES}}},
     f"at most {MAX_SCHEMA_BYTES}"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": json.loads('{"a":' * 40 + "1" + "}" * 40)}},
     "nests deeper"),
])
def test_bad_shape_is_refused_naming_response_format(value, part):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams.from_dict({"response_format": value})
    assert e.value.param == "response_format"
    assert part in e.value.message


def test_response_format_survives_the_worker_round_trip():
    p = SamplingParams(max_tokens=9, response_format=schema_format(PERSON))
    assert SamplingParams.from_dict(p.model_dump()) == p


def test_compiled_grammars_are_cached_by_the_schemas_canonical_json(tokenizer):
    so = StructuredOutput(tokenizer, tokenizer.vocab_size, {tokenizer.eos_token_id}, cache_size=2)
    a = so.compile(schema_format({"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "string"}}}))
    b = so.compile(schema_format({"properties": {"y": {"type": "string"}, "x": {"type": "integer"}}, "type": "object"}))
    assert a is b and so.cached() == 1
    assert so.compile(schema_format({"type": "object"}, name="other")) is so.compile({"type": "json_object"})
    so.compile(schema_format({"type": "array"}))
    assert so.cached() == 2  # bounded: the least recently used one was dropped
    assert so.compile(schema_format({"type": "object", "properties": {"x": {"type": "integer"},
                                                                      "y": {"type": "string"}}})) is not a


def test_a_token_the_grammar_rejects_fails_only_that_request(tokenizer):
    so = StructuredOutput(tokenizer, tokenizer.vocab_size, {tokenizer.eos_token_id})
    grammar = so.compile({"type": "json_object"})
    so.start("a", grammar)
    so.start("b", grammar)
    with pytest.raises(GrammarRejected):
        so.accept("a", tokenizer.encode("x", add_special_tokens=False)[0])
    assert so.accept("b", tokenizer.encode("{", add_special_tokens=False)[0]) is False
    assert so.accept("free", 123) is False  # an unconstrained request is never touched


def test_async_engine_compiles_before_the_step_loop(engine, tokenizer):
    """Through AsyncLLMEngine the grammar is compiled on a worker thread (the engine's step thread
    only finds it in the request) and a bad schema is refused before anything is queued."""
    aengine = AsyncLLMEngine(engine)
    compiled_on: list[str] = []
    compile_ = engine.structured.compile

    def recording(fmt):
        import threading
        compiled_on.append(threading.current_thread().name)
        return compile_(fmt)

    engine.structured.compile = recording

    async def run():
        text = ""
        async for out in aengine.generate(req("async", tokenizer, "Describe a pilot.", max_tokens=80, temperature=0,
                                              response_format=schema_format(PERSON, "pilot"))):
            text += out.text
            reason = out.finish_reason
        with pytest.raises(InvalidRequestError):
            async for _ in aengine.generate(req("async-bad", tokenizer, "Hi", max_tokens=4,
                                                response_format=schema_format({"type": "nonsense"}))):
                pass
        return text, reason

    try:
        text, reason = asyncio.run(run())
    finally:
        del engine.structured.compile
        aengine.shutdown()
    assert reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)
    assert compiled_on and "tessera-engine" not in compiled_on


def test_without_the_library_a_response_format_is_refused(tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance now raises ImportError
    so = StructuredOutput(tokenizer, tokenizer.vocab_size, {tokenizer.eos_token_id})
    with pytest.raises(InvalidRequestError) as e:
        so.compile({"type": "json_object"})
    assert e.value.param == "response_format" and "llguidance" in e.value.message
