"""OpenTelemetry traces of the request path: one trace per request, from the gateway across the
HTTP hop to the engine worker. Off unless the `tracing` setting is on (TESSERA_TRACING=true).

Spans (instrumentation scope "tessera"; attributes under `tessera.`, never prompt text, output
text or keys):

    gateway  SERVER "POST /v1/chat/completions"   ServerSpans: the caller's `traceparent` continued,
             |                                     this span's returned as `traceparent`; tenant,
             |                                     tenant_id, model, adapter_version, priority,
             |                                     request_id, token counts, finish_reason, usage_status
             +- auth                              tenant
             +- quota.peek, model.resolve, quota.reserve
             +- CLIENT engine.generate            one per choice (`engine_call`); request_id,
                |                                 engine_worker (HTTP), token counts, finish_reason;
                |                                 event first_token
                +- engine.route                   HTTP mode: which worker (engine_worker)
                +- worker SERVER "POST /internal/generate"   (traceparent injected by `inject`)
                   +- engine.request              the engine's view (`engine_spans`); event first_token
                      +- engine.queue             arrival -> first seat
                      +- engine.adapter_load      the adapter load it waited for, if any
                      +- engine.prefill           first seat -> first token; event per prefill chunk
                      +- engine.decode            first token -> end

With the engine in the gateway's process, engine.request hangs under engine.generate directly.
The engine's spans are made after the request finished, from the timeline the engine keeps on
each request (engine.sequence.Sequence.timings, sent on its final RequestOutput), with explicit
start and end times: the step loop creates nothing. An error sets the span's status (5xx on the
server span, an exception or an engine failure elsewhere) with its type, never its message.

Spans are recorded as plain `Span` objects (ids, times, an attribute dict; the current one in a
context variable) and handed to the SDK's BatchSpanProcessor when they end; its thread turns them
into the SDK's ReadableSpans for the exporter. The SDK's own live spans cost several times as
much per span on the request path (locks, copies) for features these spans do not use.

Setup (`setup`, once per process): an SDK TracerProvider whose sampler, exporter and service name
come from the standard variables: OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG (default
parentbased_always_on: a caller's sampled flag decides), OTEL_TRACES_EXPORTER (otlp, the default,
or none), OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (OTLP/HTTP protobuf,
default http://localhost:4318), OTEL_SERVICE_NAME (default tessera-gateway or
tessera-engine-worker), OTEL_BSP_* (the batch processor that exports off the event loop). The
sampler decides once per trace, at its server span; the spans under it follow. The propagation
format is W3C trace context only. The provider is this module's, not the global one (FastAPI's
own telemetry stays as the `otel_tracing` setting leaves it).

Off, nothing is installed (no middleware) and every helper returns at its first test of a
module global: no span, no header, nothing measurable.
"""
from __future__ import annotations

import os
import random
from contextlib import nullcontext
from contextvars import ContextVar
from time import time_ns
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
#: Paths whose requests get no server span: probes and scrapes, polled all the time.
UNTRACED_PATHS = frozenset({"/health", "/ready", "/metrics"})
#: Events kept per span (the SDK's default limit); later prefill chunks are left out.
MAX_EVENTS = 128
_SAMPLED = trace.TraceFlags(trace.TraceFlags.SAMPLED)


class _Exporter:
    """Where ended spans go: the SDK's batch span processor, handed our `Span`s as they are (a
    deque append); the processor's own thread turns them into the SDK's ReadableSpans
    (`_Readable`) just before its exporter sends them. The SDK's own Span objects are not used on
    the request path: each costs several locks and copies, and these spans need none of it."""

    def __init__(self, provider, processor):
        self.provider, self.processor, self.sampler = provider, processor, provider.sampler

    def emit(self, s: Span) -> None:
        self.processor.on_end(s)


class _Readable:
    """A SpanExporter that turns `Span`s into ReadableSpans for `inner` (on the batch processor's
    thread, off the request path)."""

    def __init__(self, inner, resource):
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        self.inner, self.resource, self.scope = inner, resource, InstrumentationScope("tessera")
        self.Event, self.ReadableSpan = Event, ReadableSpan

    def export(self, spans):
        return self.inner.export([self.readable(s) for s in spans])

    def readable(self, s: Span):
        parent = None if s.parent_id is None else trace.SpanContext(s.trace_id, s.parent_id, s.remote_parent, _SAMPLED)
        status = trace.Status(s.status, s.status_message) if s.status is not StatusCode.UNSET else trace.Status()
        return self.ReadableSpan(
            name=s.name, context=trace.SpanContext(s.trace_id, s.span_id, False, _SAMPLED), parent=parent,
            resource=self.resource, attributes=s.attributes, kind=s.kind, status=status,
            events=[self.Event(name, attrs, at) for name, attrs, at in s.events],
            start_time=s.start, end_time=s.end, instrumentation_scope=self.scope)

    def shutdown(self):
        return self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


#: This process's exporter while tracing is on; None while it is off (every helper's first test).
_on: _Exporter | None = None
_configured: _Exporter | None = None  # what `setup` made, kept while `set_enabled(False)`
#: The current span of this task (context variables follow asyncio tasks and their children).
_current: ContextVar[Span | None] = ContextVar("tessera_span", default=None)


class Span:
    """One span of a request's trace, recorded in plain attributes and handed to the exporter
    when it ends (if its trace is sampled). Unsampled spans keep their ids (for `traceparent`)
    and record nothing."""

    __slots__ = (
        "attributes",
        "end",
        "events",
        "kind",
        "name",
        "parent_id",
        "remote_parent",
        "sampled",
        "span_id",
        "start",
        "status",
        "status_message",
        "trace_id",
    )
    #: What the SDK's batch processor checks before queueing a span (only sampled ones are emitted).
    context = trace.SpanContext(1, 1, False, _SAMPLED)

    def __init__(self, name: str, kind: SpanKind, trace_id: int, parent_id: int | None, sampled: bool, *,
                 remote_parent: bool = False, start: int | None = None, attributes: dict | None = None):
        self.name, self.kind, self.trace_id, self.parent_id = name, kind, trace_id, parent_id
        self.span_id = random.getrandbits(64) or 1
        self.remote_parent, self.sampled = remote_parent, sampled
        self.start = time_ns() if start is None else start
        self.end: int | None = None
        self.attributes = attributes if attributes is not None else {}
        self.events: list = []
        self.status, self.status_message = StatusCode.UNSET, None

    def child(self, name: str, kind: SpanKind = SpanKind.INTERNAL, *, start: int | None = None,
              attributes: dict | None = None) -> Span:
        return Span(name, kind, self.trace_id, self.span_id, self.sampled, start=start, attributes=attributes)

    def is_recording(self) -> bool:
        return self.sampled

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value

    def set_attributes(self, attributes: dict) -> None:
        self.attributes.update(attributes)

    def add_event(self, name: str, attributes: dict | None = None, timestamp: int | None = None) -> None:
        if len(self.events) < MAX_EVENTS:
            self.events.append((name, attributes, time_ns() if timestamp is None else timestamp))

    def set_status(self, code: StatusCode, message: str | None = None) -> None:
        self.status, self.status_message = code, message

    def update_name(self, name: str) -> None:
        self.name = name

    def traceparent(self) -> str:
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-{'01' if self.sampled else '00'}"

    def finish(self, end: int | None = None) -> None:
        """End it (now, or at `end`) and export it if sampled; later calls change nothing."""
        if self.end is None:
            self.end = time_ns() if end is None else end
            exporter = _on
            if self.sampled and exporter is not None:
                exporter.emit(self)


class _NoSpan:
    """What the helpers hand out while tracing is off: every call does nothing."""

    sampled = False

    def set_attribute(self, key, value) -> None: ...

    def set_attributes(self, attributes) -> None: ...

    def add_event(self, name, attributes=None, timestamp=None) -> None: ...

    def set_status(self, code, message=None) -> None: ...

    def is_recording(self) -> bool:
        return False


NO_SPAN = _NoSpan()
_NOOP = nullcontext(NO_SPAN)


def setup(service_name: str, *, exporter: Any = None, sampler: Any = None) -> None:
    """Turn tracing on in this process (a second call only turns it on again). `exporter` and
    `sampler` replace what the OTEL_* variables say (the benchmark's in-memory exporter)."""
    global _on, _configured
    if _configured is None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or service_name})
        # sampler None: the provider reads OTEL_TRACES_SAMPLER(_ARG). The provider is not made the
        # global one: FastAPI's own telemetry, on by default in an app that does not turn it off
        # (the engine worker's), would then trace every poll and dependency.
        provider = TracerProvider(sampler=sampler, resource=resource)
        if exporter is None and os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() != "none":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter,
            )

            exporter = OTLPSpanExporter()
        processor = None
        if exporter is not None:
            processor = BatchSpanProcessor(_Readable(exporter, resource))
            provider.add_span_processor(processor)  # flushed and shut down with the provider at exit
        _configured = _Exporter(provider, processor or _Discard())
    _on = _configured


class _Discard:
    def on_end(self, span) -> None: ...

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def set_enabled(on: bool) -> None:
    """Switch tracing off and on again after `setup` (the benchmark's peer rounds)."""
    global _on
    _on = _configured if on else None


def enabled() -> bool:
    return _on is not None


def flush() -> None:
    """Export every ended span now (tests, shutdown)."""
    if _configured is not None:
        _configured.processor.force_flush()


def _failed(span, error: BaseException) -> None:
    """Mark `span` failed by `error`: its type (and an ApiError's HTTP status and code), never the
    message, which may quote what the tenant sent."""
    status = getattr(error, "status", None)
    code = getattr(error, "code", None)
    kind = code if isinstance(code, str) else type(error).__name__
    span.set_attribute("error.type", kind)
    if isinstance(status, int):
        span.set_attribute("http.response.status_code", status)
    span.set_status(StatusCode.ERROR, kind)


class _Child:
    """A child of the current span around a block, current inside it (`span`)."""

    __slots__ = ("kind", "name", "span", "token")

    def __init__(self, name: str, kind: SpanKind):
        self.name, self.kind = name, kind

    def __enter__(self):
        parent = _current.get()
        if parent is None:  # outside a traced request: nothing to hang it on
            self.span = None
            return NO_SPAN
        self.span = parent.child(self.name, self.kind)
        self.token = _current.set(self.span)
        return self.span

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self.span is not None:
            _current.reset(self.token)
            if exc is not None:
                _failed(self.span, exc)
            self.span.finish()
        return False


def span(name: str, kind: SpanKind = SpanKind.INTERNAL):
    """`with span("quota.peek") as s:` a child of the current span around the block (an exception
    leaving it marks it failed); off, or outside a traced request, `s` ignores every call."""
    if _on is None:
        return _NOOP
    return _Child(name, kind)


def annotate(**attributes: Any) -> None:
    """Set `tessera.<name>` attributes on the current span (None values are left out)."""
    if _on is None:
        return
    current = _current.get()
    if current is not None and current.sampled:
        current.attributes.update({f"tessera.{k}": v for k, v in attributes.items() if v is not None})


def current_span():
    """The current span (NO_SPAN, which records nothing, while tracing is off or outside a trace)."""
    current = _current.get() if _on is not None else None
    return NO_SPAN if current is None else current


def inject(headers: dict[str, str]) -> dict[str, str]:
    """`headers` plus the current span's `traceparent` (a copy); `headers` itself while off or
    outside a trace."""
    if _on is None:
        return headers
    current = _current.get()
    return headers if current is None else headers | {"traceparent": current.traceparent()}


def _server_span(exporter: _Exporter, name: str, traceparent: bytes | None, attributes: dict) -> Span:
    """A request's SERVER span: a child of the caller's `traceparent` when valid, else a new trace;
    whether it is recorded is the sampler's decision (by default the caller's sampled flag)."""
    remote = None
    if traceparent is not None:
        ctx = trace.get_current_span(_PROPAGATOR.extract({"traceparent": traceparent.decode("latin-1")}))
        remote = ctx.get_span_context()
        if not remote.is_valid:
            remote = None
    trace_id = remote.trace_id if remote is not None else (random.getrandbits(128) or 1)
    parent_ctx = None if remote is None else trace.set_span_in_context(trace.NonRecordingSpan(remote))
    sampled = exporter.sampler.should_sample(parent_ctx, trace_id, name, SpanKind.SERVER,
                                             attributes).decision.is_sampled()
    return Span(name, SpanKind.SERVER, trace_id, None if remote is None else remote.span_id, sampled,
                remote_parent=remote is not None, attributes=attributes)


class ServerSpans:
    """ASGI middleware: a SERVER span per HTTP request (but UNTRACED_PATHS; with `only`, just
    those paths), child of the caller's `traceparent` when it sent a valid one, current while the
    app handles the request, and returned in the response's `traceparent` header (JSON and SSE
    alike: it goes with the response's start). Its status is an error for a 5xx or an exception.
    Install it only while tracing is on; it passes requests through when `set_enabled(False)`."""

    def __init__(self, app, *, only: frozenset[str] | None = None):
        self.app, self.only = app, only

    async def __call__(self, scope, receive, send):
        exporter = _on
        if exporter is None or scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if (path not in self.only) if self.only is not None else (path in UNTRACED_PATHS):
            return await self.app(scope, receive, send)
        traceparent = None
        for name, value in scope["headers"]:
            if name == b"traceparent":
                traceparent = value
                break
        method = scope["method"]
        span = _server_span(exporter, method, traceparent, {"http.request.method": method, "url.path": path})
        header = (b"traceparent", span.traceparent().encode())
        status = None

        async def send_traced(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        token = _current.set(span)
        try:
            await self.app(scope, receive, send_traced)
        except BaseException as e:
            _failed(span, e)
            raise
        finally:
            _current.reset(token)
            template = getattr(scope.get("route"), "path", None)
            if template is not None:  # the route's template: a bounded span name
                span.attributes["http.route"] = template
                span.name = f"{method} {template}"
            if status is not None:
                span.attributes["http.response.status_code"] = status
                if status >= 500:
                    span.set_status(StatusCode.ERROR, str(status))
            span.finish()


class _TracedStream:
    """An engine client's stream of RequestOutput deltas inside a CLIENT span "engine.generate"
    (`engine_call`): current while the client works for it (so the HTTP client's route span and
    `traceparent` belong to it), ended by the final delta, an exception or `aclose`."""

    __slots__ = ("first_seen", "inner", "request", "span")

    def __init__(self, inner, span: Span, request):
        self.inner, self.span, self.request = inner, span, request
        self.first_seen = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        token = _current.set(self.span)
        try:
            out = await self.inner.__anext__()
        except StopAsyncIteration:
            self.span.finish()
            raise
        except BaseException as e:
            if self.span.end is None:
                _failed(self.span, e)
            self.span.finish()
            raise
        finally:
            _current.reset(token)
        if not self.first_seen and out.token_ids:
            self.first_seen = True
            self.span.add_event("first_token")
        if out.finished and self.span.end is None:
            _set_outcome(self.span, out)
            if out.timings and self.span.sampled:  # the engine in this process: its spans go under this one
                engine_spans(out, parent=self.span, request=self.request)
            self.span.finish()
        return out

    async def aclose(self):
        token = _current.set(self.span)
        try:
            await self.inner.aclose()
        finally:
            _current.reset(token)
            if self.span.end is None:
                self.span.attributes["tessera.finish_reason"] = "abort"
                self.span.finish()


def _request_attributes(request) -> dict[str, Any]:
    """A GenerationRequest's attributes: ids and labels, no prompt."""
    attrs = {"tessera.request_id": request.request_id, "tessera.tenant_id": request.tenant_id,
             "tessera.priority": getattr(request.priority, "name", str(request.priority))}
    if request.adapter is not None:
        attrs["tessera.adapter_version"] = request.adapter
    return attrs


def _set_outcome(span: Span, out) -> None:
    """The final RequestOutput's counts and finish reason on `span`; an engine failure marks it."""
    span.set_attributes({"tessera.prompt_tokens": out.prompt_tokens, "tessera.cached_tokens": out.cached_tokens,
                         "tessera.completion_tokens": out.completion_tokens,
                         "tessera.finish_reason": out.finish_reason or ""})
    if out.finish_reason == "error":
        kind = ("invalid_param" if out.invalid_param else "adapter_fault" if out.adapter_fault else "engine_error")
        span.set_attribute("error.type", kind)
        span.set_status(StatusCode.ERROR, kind)


def engine_call(stream, request):
    """`stream` (EngineClient.generate(request)) inside its CLIENT span "engine.generate", a child
    of the current span; `stream` itself while tracing is off or outside a traced request."""
    if _on is None:
        return stream
    parent = _current.get()
    if parent is None:
        return stream
    return _TracedStream(stream, parent.child("engine.generate", SpanKind.CLIENT,
                                              attributes=_request_attributes(request)), request)


def engine_spans(out, *, parent, request) -> None:
    """The engine's spans of one finished request (module docstring), made now from its final
    output's `timings` (Unix ns) under `parent`: nothing while off, without timings, or when
    `parent` is not sampled."""
    t = out.timings
    if _on is None or not t or not parent.is_recording():
        return
    arrival, seated, first, end = t["arrival"], t["first_scheduled"], t["first_token"], t["finished"]
    if arrival is None or end is None:
        return
    attrs = _request_attributes(request)
    attrs["tessera.preemptions"] = t.get("preemptions", 0)
    req = parent.child("engine.request", start=arrival, attributes=attrs)
    _set_outcome(req, out)

    def child(name: str, start: int, stop: int, attributes: dict | None = None, events=()) -> None:
        s = req.child(name, start=start, attributes=attributes)
        for event, event_attributes, at in events:
            s.add_event(event, event_attributes, at)
        s.finish(stop)

    child("engine.queue", arrival, seated if seated is not None else end)
    load = t.get("adapter_load")
    if load:
        # A seat is stamped with its scheduling pass's start, which the load may end within.
        stop = load[1] if seated is None else max(load[0], min(load[1], seated))
        child("engine.adapter_load", load[0], stop, {"tessera.adapter_version": request.adapter or ""})
    chunks = []
    if seated is not None:
        prefilled = first if first is not None else end
        # Chunks after the first token recompute a preempted request's KV: events of its decode.
        chunks = [("prefill_chunk" if done <= prefilled else "recompute_chunk",
                   {"tessera.tokens": n, "tessera.step_start_ns": start}, done)
                  for start, done, n in t.get("prefill_chunks") or ()]
        child("engine.prefill", seated, prefilled,
              {"tessera.prompt_tokens": out.prompt_tokens, "tessera.cached_tokens": out.cached_tokens},
              [c for c in chunks if c[0] == "prefill_chunk"])
    if first is not None:
        req.add_event("first_token", None, first)
        child("engine.decode", first, end, {"tessera.completion_tokens": out.completion_tokens},
              [c for c in chunks if c[0] == "recompute_chunk"])
    req.finish(end)
