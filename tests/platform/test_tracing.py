"""OpenTelemetry traces across real processes: a gateway (`tessera serve`) and an engine worker
(`tessera engine-worker`), both with TESSERA_TRACING=true, export OTLP/HTTP to a receiver this test
runs (ExportTraceServiceRequest protobufs decoded with opentelemetry-proto). What it shows:
- one adapter request is one trace: the gateway's server span, its auth / quota / model
  resolution / engine-call children, the engine call's route span and the worker's server span
  under it, and under that the engine's request span with queue, adapter load, prefill (chunk
  events) and decode, and the first token as an event; tenant, adapter version, priority, request
  id and token counts as attributes; the response's `traceparent` names the gateway's span;
  neither the prompt, the output nor the API key is in anything exported;
- a caller's `traceparent` is continued on a stream (same trace, the gateway's span its child);
- a refusal (an unknown model) marks the failing step's span, not the 4xx server span;
- off by default: the embedded form (the engine in the gateway's process) with the exporter's
  endpoint set but the default settings returns no `traceparent` and exports nothing;
- the standard sampler variables are honoured: with OTEL_TRACES_SAMPLER=traceidratio at 0, a
  gateway returns an unsampled `traceparent` (a caller's trace id kept) and nothing of those
  traces is exported, by it or by the worker that follows its flag."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import NamedTuple

import httpx
import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from tessera import services
from tessera.app import create_app
from tessera.engine_client.inprocess import InProcessEngineClient
from tessera.observability import tracing
from tessera.settings import PlatformSettings

from adapter_registry import services as registry
from adapter_registry.migrate import upgrade
from tessera_core.context import build_context

from ..adapter_registry.registry_helpers import write_adapter
from ..engine.lora_fixtures import SMOLLM2
from .chaos_helpers import TESSERA, Service, free_port
from .conftest import Platform, ServerThread

SECRET = "tracing-engine-secret-" + "s" * 16
BASE = "SmolLM2-135M-Instruct"
CANARY = "zebra-canary-4417"  # in every prompt; must never be exported
UNSAMPLED = "tessera-gateway-unsampled"  # the service name of the gateway that samples nothing


class Receiver:
    """An OTLP/HTTP trace receiver on loopback: every span it was sent, flattened to dicts, and
    every raw payload (to look for what must not be exported)."""

    def __init__(self):
        self.spans: list[dict] = []
        self.payloads: list[bytes] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["content-length"]))
                assert self.path == "/v1/traces", self.path
                receiver.add(body)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, body: bytes) -> None:
        req = ExportTraceServiceRequest.FromString(body)
        spans = []
        for rs in req.resource_spans:
            service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append({
                        "service": service, "name": s.name, "kind": s.kind, "trace": s.trace_id.hex(),
                        "id": s.span_id.hex(), "parent": s.parent_span_id.hex(), "start": s.start_time_unix_nano,
                        "end": s.end_time_unix_nano, "attrs": {a.key: _value(a.value) for a in s.attributes},
                        "events": [(e.name, {a.key: _value(a.value) for a in e.attributes}) for e in s.events],
                        "status": s.status.code, "status_message": s.status.message})
        with self.lock:
            self.payloads.append(body)
            self.spans.extend(spans)

    def trace(self, trace_id: str, until, timeout: float = 20.0) -> list[dict]:
        """The spans of `trace_id` once `until(spans)` holds (the exporters batch)."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                spans = [s for s in self.spans if s["trace"] == trace_id]
            if until(spans):
                return spans
            assert time.monotonic() < deadline, [(s["service"], s["name"]) for s in spans]
            time.sleep(0.05)


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def names(spans) -> set[str]:
    return {s["name"] for s in spans}


#: Every span of a base-model request's trace (the exporters of both processes batch on their own
#: schedules, so a test waits for all it reads, not for the first or the last to be made).
TREE = {"POST /v1/chat/completions", "auth", "quota.peek", "model.resolve", "quota.reserve", "engine.generate",
        "engine.route", "POST /internal/generate", "engine.request", "engine.queue", "engine.prefill", "engine.decode"}


def one(spans, name: str) -> dict:
    (s,) = [s for s in spans if s["name"] == name]
    return s


class Traced(NamedTuple):
    url: str  # the gateway's
    key: str
    tenant: str
    sha: str  # the adapter version's
    receiver: Receiver
    unsampled_url: str  # the gateway sampled by OTEL_TRACES_SAMPLER=traceidratio, ARG=0


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """A receiver, an engine worker and a gateway exporting to it, a second gateway that samples
    nothing (below); a tenant with an adapter "bot" (a ready version the worker has not loaded
    yet)."""
    root = tmp_path_factory.mktemp("tracing")
    receiver = Receiver()
    db = f"sqlite:///{root / 'tessera.db'}"
    settings = PlatformSettings(_env_file=None, database_url=db, object_store_root=root / "objects",
                                adapter_cache_dir=root / "upload-cache")
    upgrade(settings)
    ctx = build_context(settings)
    with ctx.session_factory() as s:
        services.upsert_plan(session=s, name="traced", requests_per_minute=1000, tokens_per_minute=10**7,
                             max_concurrent_requests=10, monthly_token_budget=10**9)
        tenant = services.create_tenant(session=s, name="acme", plan="traced")
        _, key = services.issue_key(session=s, tenant=tenant)
        version = registry.upload_adapter(session=s, store=ctx.store, tenant=tenant, name="bot",
                                          settings=settings.model_copy(update={"served_base_models": [SMOLLM2]}),
                                          source=write_adapter(root / "bot", seed=3))
        assert version.status == "ready", version.rejection_reason
        sha = version.sha256
    ctx.engine.dispose()
    shared = {"database_url": db, "object_store_root": root / "objects", "tracing": "true"}
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "50"}
    wport, gport, uport = free_port(), free_port(), free_port()
    worker_url = f"http://127.0.0.1:{wport}"
    worker = Service("worker", [TESSERA, "engine-worker", "--port", str(wport), "--secret", SECRET], cwd=root,
                     settings=shared | {"engine_threads": 1, "engine_kv_cache_mib": 64,
                                        "adapter_cache_dir": root / "wcache"})
    gateway = Service("gateway", [TESSERA, "serve"], cwd=root, settings=shared | {
        "port": gport, "engine_mode": "http", "engine_urls": json.dumps([worker_url]),
        "engine_secret": SECRET, "adapter_cache_dir": root / "gcache", "usage_outbox_dir": root / "outbox"})
    # A second gateway over the same worker whose sampler the standard variables set to sample
    # nothing: traceidratio at 0, which (not parent-based) a caller's sampled flag does not override.
    unsampled = Service(UNSAMPLED, [TESSERA, "serve"], cwd=root, settings=shared | {
        "port": uport, "engine_mode": "http", "engine_urls": json.dumps([worker_url]),
        "engine_secret": SECRET, "adapter_cache_dir": root / "ucache", "usage_outbox_dir": root / "uoutbox"})
    for svc in (worker, gateway, unsampled):
        svc.env = {k: v for k, v in svc.env.items() if not k.startswith("OTEL_")} | otel
    unsampled.env |= {"OTEL_SERVICE_NAME": UNSAMPLED, "OTEL_TRACES_SAMPLER": "traceidratio",
                      "OTEL_TRACES_SAMPLER_ARG": "0"}
    processes = (worker, gateway, unsampled)
    try:
        for svc in processes:  # all load at once
            svc.start()
        worker.wait_until_answers(f"{worker_url}/ready")
        gateway.wait_until_answers(f"http://127.0.0.1:{gport}/ready")
        unsampled.wait_until_answers(f"http://127.0.0.1:{uport}/ready")
        yield Traced(f"http://127.0.0.1:{gport}", key, tenant.name, sha, receiver, f"http://127.0.0.1:{uport}")
    finally:
        for svc in processes:
            svc.stop()
        receiver.server.shutdown()


def test_one_request_is_one_trace_from_the_gateway_through_the_worker(traced):
    url, key, tenant, sha, receiver, *_ = traced
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="bot", messages=[{"role": "user", "content": f"Say {CANARY} twice."}], max_tokens=4, temperature=0)
    answer = raw.parse()
    version, trace_id, span_id, flags = raw.headers["traceparent"].split("-")
    assert version == "00" and int(flags, 16) & 1  # sampled

    spans = receiver.trace(trace_id, lambda s: (TREE | {"engine.adapter_load"}) <= names(s))
    by_id = {s["id"]: s for s in spans}
    server = one(spans, "POST /v1/chat/completions")
    assert server["id"] == span_id and server["parent"] == "" and server["service"] == "tessera-gateway"
    assert server["kind"] == 2  # SERVER
    assert server["attrs"]["http.response.status_code"] == 200 and server["attrs"]["http.route"] == \
        "/v1/chat/completions"
    assert {k: server["attrs"][k] for k in ("tessera.tenant", "tessera.adapter_version", "tessera.priority",
                                             "tessera.request_id", "tessera.model", "tessera.completion_tokens",
                                             "tessera.prompt_tokens", "tessera.finish_reason")} == {
        "tessera.tenant": tenant, "tessera.adapter_version": sha, "tessera.priority": "standard",
        "tessera.request_id": answer.id, "tessera.model": "bot",
        "tessera.completion_tokens": answer.usage.completion_tokens,
        "tessera.prompt_tokens": answer.usage.prompt_tokens, "tessera.finish_reason": "length"}

    # The gateway's steps, in order, each a child of its server span.
    steps = sorted((s for s in spans if s["parent"] == span_id), key=lambda s: s["start"])
    assert [s["name"] for s in steps] == ["auth", "quota.peek", "model.resolve", "quota.reserve", "engine.generate"]
    assert one(spans, "auth")["attrs"]["tessera.tenant"] == tenant
    assert one(spans, "model.resolve")["attrs"]["tessera.adapter_version"] == sha
    call = one(spans, "engine.generate")
    assert call["kind"] == 3  # CLIENT
    assert call["attrs"]["tessera.engine_worker"] == "worker-0" and call["attrs"]["tessera.request_id"] == answer.id
    assert "first_token" in [e for e, _ in call["events"]]
    assert one(spans, "engine.route")["parent"] == call["id"]

    # Across the hop: the worker's server span is the engine call's child, in the same trace.
    hop = one(spans, "POST /internal/generate")
    assert hop["service"] == "tessera-engine-worker" and hop["parent"] == call["id"] and hop["kind"] == 2
    request = one(spans, "engine.request")
    assert request["parent"] == hop["id"]
    assert {k: request["attrs"][k] for k in ("tessera.request_id", "tessera.adapter_version", "tessera.priority",
                                              "tessera.completion_tokens", "tessera.finish_reason")} == {
        "tessera.request_id": answer.id, "tessera.adapter_version": sha, "tessera.priority": "standard",
        "tessera.completion_tokens": 4, "tessera.finish_reason": "length"}
    assert request["attrs"]["tessera.prompt_tokens"] == answer.usage.prompt_tokens
    assert "first_token" in [e for e, _ in request["events"]]
    parts = {s["name"]: s for s in spans if s["parent"] == request["id"]}
    assert set(parts) == {"engine.queue", "engine.adapter_load", "engine.prefill", "engine.decode"}
    # The engine's timeline, in order and inside the request: queued (the adapter loading), then
    # prefilled in chunks, then decoded from the first token on.
    queue, load, prefill, decode = (parts[n] for n in ("engine.queue", "engine.adapter_load", "engine.prefill",
                                                       "engine.decode"))
    assert request["start"] == queue["start"] <= queue["end"] == prefill["start"] <= prefill["end"] \
        == decode["start"] <= decode["end"] == request["end"]
    assert load["end"] <= prefill["start"] and load["attrs"]["tessera.adapter_version"] == sha
    chunks = [a for e, a in prefill["events"] if e == "prefill_chunk"]
    assert sum(c["tessera.tokens"] for c in chunks) + prefill["attrs"]["tessera.cached_tokens"] == \
        answer.usage.prompt_tokens
    assert hop["start"] <= request["start"] and request["end"] <= hop["end"]
    for s in spans:  # every span hangs in this one tree
        assert s["parent"] == "" or s["parent"] in by_id, s["name"]

    # Neither the prompt nor the key is in anything either process exported.
    exported = b"".join(receiver.payloads)
    assert CANARY.encode() not in exported and key.encode() not in exported


def test_a_callers_traceparent_is_continued_and_returned_on_a_stream(traced):
    url, key, _, _, receiver, *_ = traced
    caller_trace, caller_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    body = {"model": BASE, "messages": [{"role": "user", "content": f"Hi {CANARY}"}], "max_tokens": 3,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60,
                      headers={"authorization": f"Bearer {key}", "traceparent": f"00-{caller_trace}-{caller_span}-01"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        returned = r.headers["traceparent"]
        assert r.read().endswith(b"data: [DONE]\n\n")
    _, trace_id, span_id, _ = returned.split("-")
    assert trace_id == caller_trace and span_id != caller_span

    spans = receiver.trace(caller_trace, lambda s: TREE <= names(s))
    server = one(spans, "POST /v1/chat/completions")
    assert server["id"] == span_id and server["parent"] == caller_span
    assert one(spans, "POST /internal/generate")["parent"] == one(spans, "engine.generate")["id"]
    assert "engine.adapter_load" not in names(spans)  # the base model: nothing to load
    assert server["attrs"]["tessera.completion_tokens"] == 3


def test_a_refusal_marks_the_step_that_refused(traced):
    url, key, _, _, receiver, *_ = traced
    r = httpx.post(f"{url}/v1/chat/completions", timeout=30, headers={"authorization": f"Bearer {key}"},
                   json={"model": "no-such-adapter", "messages": [{"role": "user", "content": CANARY}]})
    assert r.status_code == 404
    _, trace_id, span_id, _ = r.headers["traceparent"].split("-")
    spans = receiver.trace(trace_id, lambda s: {"POST /v1/chat/completions", "model.resolve"} <= names(s))
    server = one(spans, "POST /v1/chat/completions")
    assert server["attrs"]["http.response.status_code"] == 404 and server["status"] == 0  # a 4xx: not a server error
    resolve = one(spans, "model.resolve")
    assert resolve["status"] == 2 and resolve["attrs"]["error.type"] == r.json()["error"]["code"]
    assert resolve["parent"] == span_id
    assert "engine.generate" not in names(spans)


CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER = f"00-{CALLER_TRACE}-00f067aa0ba902b7-01"  # a caller that sampled its trace


def _chat(url: str, key: str, traceparent: str | None, stream: bool = False) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} | ({"traceparent": traceparent} if traceparent else {})
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, headers=headers, json={
        "model": BASE, "messages": [{"role": "user", "content": f"Hi {CANARY}"}], "max_tokens": 2, "temperature": 0,
        "stream": stream})
    assert r.status_code == 200, r.text
    return r


def test_tracing_is_off_by_default_in_the_embedded_form(platform_settings, aengine, monkeypatch):
    """The embedded form (the engine in the gateway's process) with the default settings, the
    exporter's endpoint pointing at a receiver: no `traceparent` returned, whatever the caller
    sent, and nothing exported."""
    receiver = Receiver()
    monkeypatch.delenv("TESSERA_TRACING", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    assert PlatformSettings.model_fields["tracing"].default is False and not platform_settings.tracing
    app = create_app(platform_settings, engine_client=InProcessEngineClient(aengine))
    try:
        with ServerThread(app) as server:
            p = Platform(server.url, platform_settings, app)
            key = p.tenant().key
            for traceparent in (None, CALLER):
                for stream in (False, True):
                    assert "traceparent" not in _chat(p.url, key, traceparent, stream).headers
            assert not tracing.enabled()
            tracing.flush()  # (a no-op unless something set tracing up)
            time.sleep(0.3)
            assert receiver.payloads == []
    finally:
        receiver.server.shutdown()


def test_the_standard_sampler_variables_are_honoured(traced):
    """The gateway sampled by OTEL_TRACES_SAMPLER=traceidratio, OTEL_TRACES_SAMPLER_ARG=0: its
    `traceparent` says "not sampled" (a caller's trace id continued, its sampled flag overridden),
    and nothing of those traces is exported, by it or by the worker, which follows the flag."""
    receiver, url = traced.receiver, traced.unsampled_url
    version, trace_id, _, flags = _chat(url, traced.key, None).headers["traceparent"].split("-")
    assert (version, flags) == ("00", "00")
    _, caller_trace, _, flags = _chat(url, traced.key, CALLER, stream=True).headers["traceparent"].split("-")
    assert (caller_trace, flags) == (CALLER_TRACE, "00")
    # Then a sampled request through the other gateway: once its trace (the worker's spans too)
    # has arrived, the worker's spans of the requests above would have as well; the unsampled
    # gateway's exporter sends within its 50 ms schedule.
    r = _chat(traced.url, traced.key, None)
    receiver.trace(r.headers["traceparent"].split("-")[1], lambda s: TREE <= names(s))
    time.sleep(0.3)
    with receiver.lock:
        leaked = [(s["service"], s["name"]) for s in receiver.spans
                  if s["service"] == UNSAMPLED or s["trace"] in (trace_id, CALLER_TRACE)]
    assert leaked == []
