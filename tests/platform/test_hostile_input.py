"""Tenant input never produces a 5xx, through the public API: text that is valid JSON but not
valid Unicode, model references with odd version parts, response formats (and tools) whose
grammar cannot be served, and a grammar that fails mid-generation are each a 4xx naming the
field, while another tenant's greedy stream comes out unchanged and within a bound of its idle
latency (`while_victim_streams`); a property test sends any JSON body to the tenant endpoints and
never gets a 5xx."""
from __future__ import annotations

import json
import os
import statistics
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from .conftest import Platform, ServerThread
from .test_engine_resilience import _stream_text
from .test_gateway_hostile import gateway
from .test_gateway_http_engine import gateway_for, worker  # noqa: F401 - the worker fixture

pytest.importorskip("llguidance")

BASE = "SmolLM2-135M-Instruct"
PIRATE = Path(__file__).resolve().parents[2] / "platform" / "tessera" / "demo_adapters" / "pirate"
HI = [{"role": "user", "content": "Hi"}]
LONE = "\ud800"


# Another tenant's greedy stream (24 tokens) while the hostile requests run: its text is its idle
# text, and it takes at most VICTIM_FACTOR x its idle latency (the median of 3 idle runs measured
# in the same test) + VICTIM_MARGIN_S. The hostile requests share the gateway's event loop, the
# CPU and the engine's steps (a few short generations) with it, but it never waits behind them.
# Measured on a shared 2-core machine under a load of 3.5-6 (three runs): idle 0.93-3.5 s; under
# the hostile load at most 2.9x idle, for the unservable grammars (their compiles take the CPU
# for 1.5-2 s, whatever the victim's own latency: 2.98 s against 1.02 s idle, 2.58 s against
# 0.93 s), the others at most 2.4x. The margin covers that added CPU time on a 2-core CI machine
# whose idle latency is shorter; a stream that waited behind the hostile requests (the issue's
# 15-36 s) is still far outside the bound.
VICTIM_FACTOR = 3.0
VICTIM_MARGIN_S = 2.0


def _timed_stream(platform, tenant, started: threading.Event | None = None) -> tuple[str, float]:
    t0 = time.perf_counter()
    text = _stream_text(platform, tenant, started)
    return text, time.perf_counter() - t0


def victim_alone(platform, victim) -> tuple[str, float]:
    """The victim's greedy stream with the engine to itself: (its text, median latency of 3)."""
    runs = [_timed_stream(platform, victim) for _ in range(3)]
    assert len({text for text, _ in runs}) == 1, runs
    return runs[0][0], statistics.median(s for _, s in runs)


def while_victim_streams(platform, victim, alone: tuple[str, float], other):
    """Run `other()` once `victim`'s greedy stream has begun; check the stream's text is its idle
    text and its latency within the bound above; returns other's result."""
    text_alone, idle_s = alone
    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(_timed_stream, platform, victim, started)
        assert started.wait(120), "the victim's stream never started"
        result = other()
        text, took = stream.result(timeout=120)
    bound = VICTIM_FACTOR * idle_s + VICTIM_MARGIN_S
    print(f"\nvictim stream: idle {idle_s:.3f} s, under hostile load {took:.3f} s (bound {bound:.2f} s)")
    assert text == text_alone
    assert took <= bound, (took, idle_s)
    return result


def post(url: str, key: str, path: str, body, **kw) -> httpx.Response:
    """POST `body` (a JSON value, escaped to ASCII so lone surrogates travel as \\uXXXX, or raw bytes)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{url}{path}", content=content, timeout=120,
                      headers={"authorization": f"Bearer {key}", "content-type": "application/json"}, **kw)


def fault_counts() -> tuple[float, float]:
    """(requests the engine failed for a fault, requests it ended for their grammar) so far."""
    faults = sum(s.value for m in REGISTRY.collect() if m.name == "tessera_engine_request_faults"
                 for s in m.samples if s.name.endswith("_total"))
    refused = REGISTRY.get_sample_value("tessera_engine_grammar_refusals_total") or 0.0
    return faults, refused


def chat_with_format(schema: dict, **extra) -> dict:
    return {"model": BASE, "messages": HI, "max_tokens": 48, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}} | extra


# ------------------------------------------------------------------ text that is not Unicode

CHAT = {"model": BASE, "messages": HI, "max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}
NOT_UNICODE = [  # (route, body, the param the 400 names)
    ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": LONE}]}, "messages[0].content"),
    ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": [{"type": "text", "text": "a" + LONE}]}]},
     "messages[0].content[0].text"),
    ("/v1/completions", {"model": BASE, "prompt": "x\udfff", "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", CHAT | {"stop": ["ok", LONE]}, "stop[1]"),
    ("/v1/chat/completions", CHAT | {"user": LONE}, "user"),
    ("/v1/chat/completions", CHAT | {"metadata": {"k": LONE}}, "metadata.k"),
    ("/v1/chat/completions", CHAT | {"metadata": {LONE: "v"}}, "metadata"),  # a key: the object holding it
    ("/v1/chat/completions", CHAT | {"tools": [TOOL | {"function": TOOL["function"] | {"description": LONE}}]},
     "tools[0].function.description"),
    ("/v1/chat/completions", CHAT | {"response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"enum": [LONE]}}}}, "response_format.json_schema.schema.enum[0]"),
    ("/v1/chat/completions", CHAT | {"model": "pirate@" + LONE}, "model"),
    ("/v1/responses", {"model": BASE, "input": LONE, "max_output_tokens": 16}, "input"),
    ("/v1/responses", {"model": BASE, "input": [{"role": "user", "content": [{"type": "input_text", "text": LONE}]}],
                       "max_output_tokens": 16}, "input[0].content[0].text"),
    # The same code unit as UTF-8-style bytes (ED A0 80), which Python's JSON decoder lets through.
    ("/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}'
     % BASE.encode(), "messages[0].content"),
]


def test_text_that_is_not_unicode_is_a_400_naming_the_field(platform):
    hostile, victim = platform.tenant(), platform.tenant()
    alone = victim_alone(platform, victim)

    def send_all():
        return [post(platform.url, hostile.key, route, body) for route, body, _ in NOT_UNICODE]

    answers = while_victim_streams(platform, victim, alone, send_all)
    for (route, _, param), r in zip(NOT_UNICODE, answers):
        assert r.status_code == 400, (route, param, r.text)
        error = r.json()["error"]
        assert (error["param"], error["code"], error["type"]) == (param, "invalid_unicode", "invalid_request_error")
        assert "not valid Unicode" in error["message"]
    # Nothing reached the engine or was billed.
    assert platform.usage_events(hostile.name) == []
    # Admin JSON routes answer the same way.
    r = platform.admin.post("/admin/v1/tenants", content=json.dumps({"name": "n" + LONE, "plan": "free"}),
                            headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "name", r.text
    # Characters beyond U+FFFF written as surrogate pairs are valid text.
    r = post(platform.url, hostile.key, "/v1/chat/completions",
             CHAT | {"messages": [{"role": "user", "content": "\U0001F600 ok"}]})
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------ model references


def test_model_versions_are_parsed_strictly(platform):
    t = platform.tenant()
    r = platform.admin.post(f"/admin/v1/tenants/{t.name}/adapters/pirate/versions", files=[
        ("files", (p.name, p.read_bytes())) for p in PIRATE.iterdir() if p.is_file()])
    assert r.status_code == 201 and r.json()["status"] == "ready", r.text
    client = platform.openai(t)
    assert client.chat.completions.create(model="pirate@1", messages=HI, max_tokens=1).usage.completion_tokens == 1
    victim = platform.tenant()
    alone = victim_alone(platform, victim)

    def odd_references():
        # Unicode digits int() reads ("١" is 1, "²" it refuses), numbers past the database's
        # integer range, signs, spaces, a 64-digit "digest": the same 404 as an unknown version.
        for ref in ("pirate@\u0661", "pirate@\u00b2", "pirate@\uff11", "pirate@2147483648", "pirate@" + "9" * 40,
                    "pirate@+1", "pirate@ 1", "pirate@1\n", "pirate@" + "1" * 64, "pirate@-1"):
            with pytest.raises(openai.NotFoundError) as e:
                client.chat.completions.create(model=ref, messages=HI, max_tokens=1)
            assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found", (ref, e.value.body)
            if not ref.endswith("\n"):  # (Starlette routes a path's trailing newline as no part of it)
                r = httpx.get(f"{platform.url}/v1/models/{urllib.parse.quote(ref)}",
                              headers={"authorization": f"Bearer {t.key}"}, timeout=60)
                assert r.status_code == 404, (ref, r.text)
        # Token ids in logit_bias are ASCII digits too.
        for key in ("\u0661", "\u00b2"):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model=BASE, messages=HI, max_tokens=1, logit_bias={key: 1})
            assert e.value.body["param"] == "logit_bias"

    while_victim_streams(platform, victim, alone, odd_references)


# ------------------------------------------------------------------ grammars that cannot be served

# Each passes the request's checks (shape, 32 KiB, 32 levels) and compiles, then fails in the
# grammar library at its first tokens: found by the gateway's compile before admission.
UNSERVABLE = {
    "a $ref to itself": ({"$ref": "#"}, "allows no output"),
    "a $ref cycle through $defs": ({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/b"}]}, "b": {"$ref": "#/$defs/a"}},
                                    "$ref": "#/$defs/a"}, "allows no output"),
    "a required recursive property": ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
                                      "Too many items"),
    "1000 optional properties (25 KiB)": ({"type": "object",
                                           "properties": {f"p{i}": {"type": "string"} for i in range(1000)}},
                                          "row has"),
    "nested counted repetitions": ({"type": "object", "properties": {"a": {
        "type": "string", "pattern": "^(.{1,100}){1,100}$"}}, "required": ["a"]}, "too many expressions"),
}


def unservable_answers(url: str, key: str) -> dict[str, tuple[int, dict]]:
    out = {}
    for name, (schema, _) in UNSERVABLE.items():
        for stream in (False, True):
            r = post(url, key, "/v1/chat/completions", chat_with_format(schema, stream=stream))
            out[f"{name}, stream={stream}"] = r.status_code, r.json()["error"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": UNSERVABLE["a $ref to itself"][0]}}]
    r = post(url, key, "/v1/chat/completions", CHAT | {"tools": tools, "tool_choice": "required"})
    out["a forced call of a tool whose parameters cannot be served"] = r.status_code, r.json()["error"]
    return out


def check_unservable(answers: dict[str, tuple[int, dict]]) -> None:
    for case, (status, error) in answers.items():
        expected = "tools" if "tool" in case else "response_format"
        assert status == 400 and error["param"] == expected, (case, status, error)
        assert error["type"] == "invalid_request_error" and "cannot be served" in error["message"], (case, error)
        name = case.rsplit(", stream", 1)[0]
        if name in UNSERVABLE:
            assert UNSERVABLE[name][1] in error["message"], (case, error)


def test_response_formats_that_cannot_be_served_are_refused_before_admission(platform):
    hostile, victim = platform.tenant(), platform.tenant()
    alone = victim_alone(platform, victim)
    before = fault_counts()
    answers = while_victim_streams(platform, victim, alone, lambda: unservable_answers(platform.url, hostile.key))
    check_unservable(answers)
    # Refused before admission: no quota held, nothing billed, the engine never ran them.
    assert platform.usage_events(hostile.name) == [] and fault_counts() == before


# ------------------------------------------------------------------ a grammar failing mid-generation


def failing_late(key: str) -> dict:
    """A schema whose grammar serves its first tokens (a free 16-character string, which the
    gateway's probe does not walk to its end) and then fails in the library's lexer (the second
    property's pattern); `key` makes it a schema of its own (the library's per-grammar lexer
    state would make a second request with the same one fail at its first token)."""
    return {"type": "object", "properties": {key: {"type": "string", "minLength": 16, "maxLength": 16},
                                             "r": {"type": "string", "pattern": "^(.{1,100}){1,100}$"}},
            "required": [key, "r"], "additionalProperties": False}


def stream_events(url: str, key: str, body: dict) -> tuple[int, list[dict]]:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body | {"stream": True}, timeout=120,
                      headers={"authorization": f"Bearer {key}"}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        return r.status_code, events


def check_failing_late(url: str, key: str, letters: str) -> None:
    """A JSON request and a stream with late-failing grammars: a 400 naming response_format, and
    a stream whose chunks end in an error event of the client's type."""
    r = post(url, key, "/v1/chat/completions", chat_with_format(failing_late(letters[0])))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["type"], error["code"]) == ("response_format", "invalid_request_error",
                                                              "grammar_failed"), error
    assert "too many expressions" in error["message"] and "request id chatcmpl-" in error["message"]
    status, events = stream_events(url, key, chat_with_format(failing_late(letters[1])))
    assert status == 200 and len(events) > 3
    sent = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert sent.startswith(f'{{"{letters[1]}": "') and '"r": "' in sent
    error = events[-1]["error"]
    assert (error["param"], error["type"], error["code"]) == ("response_format", "invalid_request_error",
                                                              "grammar_failed"), error


def test_a_grammar_failing_mid_generation_is_the_clients_error(platform):
    hostile, victim = platform.tenant(), platform.tenant()
    alone = victim_alone(platform, victim)
    faults, refused = fault_counts()
    while_victim_streams(platform, victim, alone, lambda: check_failing_late(platform.url, hostile.key, "xy"))
    # Not an engine fault; counted as the client's.
    assert fault_counts() == (faults, refused + 2)
    # Billed as an aborted request for what was sent (the prompt; the JSON answer sent no
    # completion, the stream its chunks): never a server error, which the availability SLO counts.
    events = sorted(platform.usage_events(hostile.name), key=lambda e: e.completion_tokens)
    assert [(e.status, e.finish_reason) for e in events] == [("aborted", "error")] * 2
    assert events[0].completion_tokens == 0 and events[1].completion_tokens >= 8
    assert all(e.prompt_tokens > 0 for e in events)


# ------------------------------------------------------------------ HTTP mode


def test_over_http_the_gateway_refuses_the_same_grammars(platform, worker, aengine):  # noqa: F811
    app, settings = gateway_for(platform, [worker.url])
    t = platform.tenant()
    in_process = unservable_answers(platform.url, t.key)
    engine_cache = aengine.engine.structured.cached()
    with ServerThread(app) as server:
        p = Platform(server.url, settings, app)
        over_http = unservable_answers(p.url, t.key)
        check_unservable(over_http)

        def scrubbed(answers):  # request ids aside (none are named in these)
            return {k: (s, e["param"], e["message"]) for k, (s, e) in answers.items()}

        assert scrubbed(over_http) == scrubbed(in_process)
        # The gateway compiled them itself: none reached the worker's engine.
        assert aengine.engine.structured.cached() == engine_cache
        assert p.gateway.grammars() is not aengine.engine.structured
        # A grammar that fails in the worker's engine mid-generation crosses the hop as the
        # client's error too.
        check_failing_late(p.url, t.key, "uv")


# ------------------------------------------------------------------ any JSON body

# Text heavy in what breaks naive handling: lone surrogates, combining marks, joiners, bidi
# controls, BOMs, astral characters, Unicode digits, NUL.
_ODD = "\u0301\u200d\u202e\ufeff\U0001F600\u0661\u00b2\x00\ud800\udfff"
# Characters drawn one by one from three sources (st.text would merge the ranges into one, where
# surrogates are too rare to matter).
TEXT = st.lists(st.one_of(st.characters(exclude_categories=()), st.sampled_from(_ODD),
                          st.integers(0xD800, 0xDFFF).map(chr)), max_size=24).map("".join)
KEYS = ["model", "messages", "prompt", "input", "role", "content", "max_tokens", "stream", "stop", "n", "tools",
        "tool_choice", "response_format", "type", "json_schema", "schema", "logit_bias", "seed", "metadata",
        "temperature", "user", "instructions", "text", "format", "function", "parameters", "name"]
# Integers small or past every bound (a mid-sized max_tokens or n would only make a body slow).
INTEGERS = st.integers(-3, 20) | st.integers(min_value=2**31 - 2) | st.integers(max_value=-(2**31) + 2)
SCALARS = (st.none() | st.booleans() | INTEGERS | st.floats() | TEXT
           | st.sampled_from([BASE, "user", "text", "json_schema", "json_object", "auto", "required"]))
JSON = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=4)
                    | st.dictionaries(st.sampled_from(KEYS) | TEXT, kids, max_size=4), max_leaves=24)
VALID = {
    "/v1/chat/completions": {"model": BASE, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "/v1/completions": {"model": BASE, "prompt": "Hi", "max_tokens": 2},
    "/v1/responses": {"model": BASE, "input": "Hi", "max_output_tokens": 16, "store": False},
}
ROUTES = [*VALID, "/v1/models"]


def _paths(value, path=()):
    """Every (container path, key) of a JSON value, for a mutation to replace or drop."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield path, k
            yield from _paths(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield path, i
            yield from _paths(v, path + (i,))


@st.composite
def mutated(draw, body):
    """`body` with one to three changes: a string field's text replaced by odd text, a field
    replaced by any JSON value or dropped, or a new field."""
    body = json.loads(json.dumps(body))
    for _ in range(draw(st.integers(1, 3))):
        spots = list(_paths(body))
        if not spots:
            break
        path, key = draw(st.sampled_from(spots))
        parent = _at(body, path)
        texts = [(p, k) for p, k in spots if isinstance(_at(body, p)[k], str)]
        action = draw(st.sampled_from(["text", "text", "replace", "drop", "add"]))
        if action == "text" and texts:
            path, key = draw(st.sampled_from(texts))
            _at(body, path)[key] = draw(TEXT)
        elif action == "replace":
            parent[key] = draw(JSON)
        elif action == "drop":
            del parent[key]
        elif isinstance(parent, dict):
            parent[draw(st.sampled_from(KEYS) | TEXT)] = draw(JSON)
    return body


def _at(value, path):
    for k in path:
        value = value[k]
    return value


def _encoded(value, how: str) -> bytes:
    if how == "ascii":  # lone surrogates travel as \uXXXX escapes
        return json.dumps(value).encode()
    if how == "utf-8":  # ... or as the bytes a UTF-8 encoder that lets them through writes
        return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")
    return json.dumps(value, ensure_ascii=False).encode("utf-16", "surrogatepass")


@st.composite
def requests(draw):
    """(method, route, body bytes): any JSON, deep nesting, or a valid body mutated, in one of
    three encodings, to any tenant route (GET /v1/models/<any text> too)."""
    route = draw(st.sampled_from(ROUTES))
    kind = draw(st.sampled_from(["mutated", "mutated", "any", "deep"]))
    if kind == "mutated" and route in VALID:
        value = draw(mutated(VALID[route]))
    elif kind == "deep":
        depth = draw(st.integers(1, 50_000))
        return "POST", route, b"[" * depth + b"]" * depth
    else:
        value = draw(JSON)
    body = _encoded(value, draw(st.sampled_from(["ascii", "ascii", "utf-8", "utf-16"])))
    if route == "/v1/models":
        method = draw(st.sampled_from(["GET", "POST"]))
        if method == "GET" and draw(st.booleans()):
            route += "/" + urllib.parse.quote(draw(TEXT).encode("utf-8", "surrogatepass"), safe="")
        return method, route, body
    return "POST", route, body


PROPERTY_EXAMPLES = int(os.environ.get("HOSTILE_INPUT_EXAMPLES", "200"))


def test_any_json_body_to_the_tenant_endpoints_is_answered_below_500(tmp_path, aengine):
    # A gateway of its own whose default max_tokens keeps generated completions short (the
    # generated integers are small or out of range).
    with gateway(tmp_path, aengine, default_max_tokens=4) as p:
        t = p.tenant()
        statuses: dict[int, int] = {}

        @settings(max_examples=PROPERTY_EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(requests())
        def answered(request):
            method, route, body = request
            r = httpx.request(method, f"{p.url}{route}", content=body, timeout=120,
                              headers={"authorization": f"Bearer {t.key}", "content-type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, f"{method} {route} {body[:300]!r} -> {r.status_code}: {r.text[:300]}"

        answered()
        assert 200 in statuses and 400 in statuses, statuses  # bodies reached the engine, and refusals
        assert httpx.get(f"{p.url}/health", timeout=10).status_code == 200
