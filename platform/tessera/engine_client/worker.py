"""The engine worker's internal API (one process per GPU, `tessera engine-worker`).

Guarded by a shared secret (Authorization: Bearer <secret>); not for tenants.
- GET  /internal/info      -> {"model", "architecture", "max_model_len", "base_model", "alive", "state"}:
                              the served model's name (ModelConfig.name, TESSERA_MODEL_NAME), family,
                              context, and its description for LoRA (`base_model`:
                              engine.lora.peft_format.BaseModelShape.to_dict), which the gateways check
                              against their deployment's model and hand to the registry.
- GET  /metrics            -> Prometheus text: the engine's series (engine/metrics.py); no secret
                              needed (no tenant data in them), so Prometheus scrapes it directly.
                              They include the Gateway API Inference Extension's model-server
                              protocol under vLLM's names (vllm:num_requests_waiting, ..._running,
                              vllm:kv_cache_usage_perc, vllm:lora_requests_info with adapter
                              version ids), so its endpoint picker reads this port with its defaults.
- GET  /health             -> 200 {"status": "ok", "engine": {state, restarts, last_error}} while
                              the process answers (liveness); no secret, no tenant data.
- GET  /ready              -> 200 {"status": "ready", ...} when the engine serves, else 503
                              {"status": "not_ready", "reason", ...} (restarting, failed, stopped)
                              or 503 {"status": "draining", ...} once the worker drains; no secret.
- GET  /internal/state     -> the replica's routing state (routing.ReplicaState.to_dict: its model's name,
                              sequences
                              running and waiting per priority class, free device slots, free KV
                              blocks, adapters per tier, draining, recent mean seat and adapter
                              load times), polled by the gateways.
- POST /internal/generate  {request_id, prompt_token_ids, params, tenant_id, priority, adapter,
  cache_salt}
  -> 200 application/x-ndjson, one RequestOutput per line, the last with "finished": true;
     400 {"message", "param"} when the engine refuses the request; 503 when it is not serving
     (restarting after its step loop died, or dead) or the worker drains: the gateway's client
     tries the next worker. A line {"engine_dead": "..."} ends a stream whose engine died
     mid-request.
Closing the connection aborts the request in the engine before its next step (frees its KV
blocks and seat), also before its first line, while it waits for a seat or is prefilled.
- POST /internal/abort    {request_id} -> 200 {"output": the aborted request's final RequestOutput
                              (`computed_prompt_tokens`: how far its prefill got) or null}: the
                              abort's report (engine.async_engine), which the gateway bills by;
                              null when the engine no longer held the request or no report came
                              within ABORT_REPORT_TIMEOUT_S.

Draining (`begin_drain`, called on SIGTERM by `tessera engine-worker`): new requests are refused
with 503 and /ready says "draining"; the requests in flight run to their end; `in_flight(app)`
reaches 0 when they have.
"""
from __future__ import annotations

import asyncio
import hmac
import json

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from engine.async_engine import READY, AsyncLLMEngine, EngineDeadError
from engine.lora.weights import base_shape_of
from engine.sampling_params import GenerationRequest, InvalidRequestError, Priority, SamplingParams
from tessera.engine_client import ABORT_REPORT_TIMEOUT_S
from tessera.engine_client.routing import ReplicaState
from tessera.observability import tracing
from tessera.streaming import ClientDisconnected, DisconnectAwareStream, cancel_on_disconnect


_OPEN_PATHS = frozenset({"/metrics", "/health", "/ready"})

router = APIRouter()


def create_worker_app(aengine: AsyncLLMEngine, *, secret: str, traced: bool = False) -> FastAPI:
    """The internal API over `aengine`; every route but /metrics, /health and /ready needs the
    shared `secret`. `traced`: OpenTelemetry spans of /internal/generate (a child of the gateway's
    `traceparent`) and of each request's time in the engine (tessera.observability.tracing)."""
    app = FastAPI(title="tessera engine worker", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = aengine
    app.state.base_model = base_shape_of(aengine.engine.model_config).to_dict()  # the served model, for LoRA
    app.state.draining = False
    app.state.in_flight = 0
    app.state.expected_authorization = f"Bearer {secret}".encode()
    app.middleware("http")(_check_secret)
    app.include_router(router)
    if traced:
        tracing.setup("tessera-engine-worker")
        app.add_middleware(tracing.ServerSpans, only=frozenset({"/internal/generate"}))
    return app


async def _check_secret(request: Request, call_next):
    """401 for a request to a guarded path without the shared secret."""
    if request.url.path in _OPEN_PATHS:
        return await call_next(request)
    given = request.headers.get("authorization", "").encode()
    if not hmac.compare_digest(given, request.app.state.expected_authorization):
        return JSONResponse({"message": "bad engine secret"}, status_code=401)
    return await call_next(request)


def begin_drain(app: FastAPI) -> None:
    """Stop admitting requests (503) and say so on /ready and /internal/state; those in flight
    continue."""
    app.state.draining = True


def in_flight(app: FastAPI) -> int:
    """Requests this worker accepted whose stream has not ended yet."""
    return app.state.in_flight


def replica_state(app: FastAPI) -> ReplicaState:
    """The routing state of this worker's engine, read from the engine's objects while its step
    thread runs: each list is copied before it is read (one C-level copy under the GIL), and the
    LoRA manager's CPU tier under its own lock, so a read never sees a container mid-change; the
    counts may be a step old, which routing tolerates (it adds its own sends between polls)."""
    aengine: AsyncLLMEngine = app.state.engine
    engine = aengine.engine
    sched = engine.scheduler
    running: dict[int, int] = {}
    waiting: dict[int, int] = {}
    running_adapters = set()
    for seq in list(sched.running):
        running[int(seq.priority)] = running.get(int(seq.priority), 0) + 1
        if seq.adapter is not None:
            running_adapters.add(seq.adapter)
    for seq in list(sched.waiting):
        waiting[int(seq.priority)] = waiting.get(int(seq.priority), 0) + 1
    lm = engine.lora_manager
    num_slots = engine.config.max_loras
    device, cpu = frozenset(), frozenset()
    if lm is not None:
        device, cpu = lm.resident()
        num_slots = lm.slots.num_slots
    state = aengine.state
    return ReplicaState(
        name="", model=engine.model_config.name, up=state == READY, draining=app.state.draining,
        state="draining" if app.state.draining else state, running=running, waiting=waiting,
        max_num_seqs=sched.max_num_seqs, num_slots=num_slots,
        free_slots=max(0, num_slots - len(running_adapters)),
        free_kv_blocks=engine.block_manager.num_free_blocks, total_kv_blocks=engine.block_manager.num_blocks,
        device_adapters=device, cpu_adapters=cpu, restarts=aengine.restarts,
        seat_s=engine.seat_times.mean_s, load_s=lm.load_times.mean_s if lm is not None else None)


def _engine(request: Request) -> AsyncLLMEngine:
    """The engine this worker app serves."""
    return request.app.state.engine


@router.get("/metrics")
async def metrics():
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


@router.get("/health")
async def health(request: Request):
    return {"status": "ok", "engine": _engine(request).health()}


@router.get("/ready")
async def ready(request: Request):
    h = _engine(request).health()
    if request.app.state.draining:
        return JSONResponse({"status": "draining", "reason": "the worker is draining (shutting down)", "engine": h},
                            status_code=503)
    if h["state"] == READY:
        return {"status": "ready", "engine": h}
    return JSONResponse({"status": "not_ready", "reason": f"the engine is {h['state']}", "engine": h},
                        status_code=503)


@router.get("/internal/info")
async def info(request: Request):
    aengine = _engine(request)
    mc = aengine.engine.model_config
    return {"model": mc.name, "architecture": mc.architecture, "max_model_len": aengine.engine.max_model_len,
            "base_model": request.app.state.base_model, "alive": aengine.is_alive, "state": aengine.state}


@router.get("/internal/state")
async def state(request: Request):
    return replica_state(request.app).to_dict()


@router.post("/internal/generate")
async def generate(request: Request):
    if request.app.state.draining:
        return JSONResponse({"message": "the engine worker is draining", "param": None}, status_code=503)
    request.app.state.in_flight += 1
    try:
        response = await _generate(request)
    except BaseException:
        request.app.state.in_flight -= 1
        raise
    if isinstance(response, DisconnectAwareStream):
        return response  # its body's end counts it out (_CountedBody)
    request.app.state.in_flight -= 1
    return response


async def _generate(request: Request):
    try:
        req = _generation_request(await request.json())
    except InvalidRequestError as e:
        return JSONResponse({"message": e.message, "param": e.param}, status_code=400)
    except (KeyError, TypeError, ValueError) as e:
        return JSONResponse({"message": f"malformed internal request: {e}", "param": None}, status_code=400)
    tracing.annotate(request_id=req.request_id, tenant_id=req.tenant_id, priority=req.priority.name,
                     adapter_version=req.adapter)
    span = tracing.current_span()  # the worker's server span: the engine's spans go under it
    stream = _engine(request).generate(req)
    try:
        # The first delta surfaces a refusal as a status code, not mid-stream. It is awaited
        # listening for the gateway's disconnect: one that leaves while the request waits for a
        # seat or is prefilled aborts it now (Starlette would not cancel this plain endpoint).
        first = await cancel_on_disconnect(request.receive, stream.__anext__)
    except ClientDisconnected:
        return Response(status_code=499)  # nobody reads it; the generator's exit aborted the request
    except InvalidRequestError as e:
        return JSONResponse({"message": e.message, "param": e.param}, status_code=400)
    except EngineDeadError as e:
        return JSONResponse({"message": str(e), "param": None}, status_code=503)
    return DisconnectAwareStream(_CountedBody(_ndjson_lines(first, stream, req, span), request.app.state),
                                 media_type="application/x-ndjson")


@router.post("/internal/abort")
async def abort(request: Request):
    try:
        request_id = str((await request.json())["request_id"])
    except (KeyError, TypeError, ValueError) as e:
        return JSONResponse({"message": f"malformed internal request: {e}", "param": None}, status_code=400)
    report = asyncio.wrap_future(_engine(request).abort(request_id))
    done, _ = await asyncio.wait([report], timeout=ABORT_REPORT_TIMEOUT_S)
    out = report.result() if done else None
    return {"output": None if out is None else vars(out) | {"timings": None}}


def _generation_request(body: dict) -> GenerationRequest:
    """The GenerationRequest a /internal/generate body describes (InvalidRequestError, KeyError,
    TypeError or ValueError when it is malformed)."""
    return GenerationRequest(
        request_id=str(body["request_id"]), prompt_token_ids=list(body["prompt_token_ids"]),
        params=SamplingParams.from_dict(body.get("params") or {}), tenant_id=str(body.get("tenant_id", "default")),
        tenant_weight=body.get("tenant_weight", 1.0),  # LLMEngine.add_request checks it
        priority=Priority.parse(body.get("priority", "standard")), adapter=body.get("adapter"),
        cache_salt=_optional_str(body.get("cache_salt")))


def _final_line(out, req: GenerationRequest, span) -> bytes:
    tracing.engine_spans(out, parent=span, request=req)
    out.timings = None  # internal to the worker
    return (json.dumps(vars(out)) + "\n").encode()


def _optional_str(value) -> str | None:
    return None if value is None else str(value)


class _CountedBody:
    """`body`, counted out of `app_state.in_flight` once when it is closed or runs out (a
    generator's own `finally` would not run if it were closed before its first line)."""

    def __init__(self, body, app_state):
        self.body, self.app_state, self.counted = body, app_state, True

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return await self.body.__anext__()
        except BaseException:
            self._count_out()
            raise

    async def aclose(self):
        self._count_out()
        await self.body.aclose()

    def _count_out(self):
        if self.counted:
            self.counted = False
            self.app_state.in_flight -= 1


async def _ndjson_lines(first, stream, req: GenerationRequest, span):
    """`first` and the rest of `stream`, one JSON line each; a line {"engine_dead"} if the engine
    dies mid-request. Closing the stream aborts the request if it did not finish. The final
    output's timeline becomes the engine's spans under `span` and is not sent."""
    try:
        if first.finished:
            yield _final_line(first, req, span)
            return
        yield (json.dumps(vars(first)) + "\n").encode()
        async for out in stream:
            yield _final_line(out, req, span) if out.finished else (json.dumps(vars(out)) + "\n").encode()
    except EngineDeadError as e:
        yield (json.dumps({"engine_dead": str(e)}) + "\n").encode()
    finally:
        await stream.aclose()  # aborts the request if it did not finish
