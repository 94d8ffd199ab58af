"""The engine worker's internal API (one process per GPU, `tessera engine-worker`).

Guarded by a shared secret (Authorization: Bearer <secret>); not for tenants.
- GET  /internal/info      -> {"model", "max_model_len", "alive", "state"}
- GET  /metrics            -> Prometheus text: the engine's series (engine/metrics.py); no secret
                              needed (no tenant data in them), so Prometheus scrapes it directly.
- GET  /health             -> 200 {"status": "ok", "engine": {state, restarts, last_error}} while
                              the process answers (liveness); no secret, no tenant data.
- GET  /ready              -> 200 {"status": "ready", ...} when the engine serves, else 503
                              {"status": "not_ready", "reason", ...} (restarting, failed, stopped);
                              no secret.
- POST /internal/generate  {request_id, prompt_token_ids, params, tenant_id, priority, adapter}
  -> 200 application/x-ndjson, one RequestOutput per line, the last with "finished": true;
     400 {"message", "param"} when the engine refuses the request; 503 when it is not serving
     (restarting after its step loop died, or dead: the gateway's client tries the next worker).
     A line {"engine_dead": "..."} ends a stream whose engine died mid-request.
Closing the connection mid-stream aborts the request in the engine (frees its KV blocks).
"""
from __future__ import annotations

import hmac
import json

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from engine.async_engine import READY, AsyncLLMEngine, EngineDeadError
from engine.sampling_params import GenerationRequest, InvalidRequestError, Priority, SamplingParams
from tessera.streaming import DisconnectAwareStream


_OPEN_PATHS = frozenset({"/metrics", "/health", "/ready"})

router = APIRouter()


def create_worker_app(aengine: AsyncLLMEngine, *, secret: str) -> FastAPI:
    """The internal API over `aengine`; every route but /metrics, /health and /ready needs the
    shared `secret`."""
    app = FastAPI(title="tessera engine worker", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = aengine
    app.state.expected_authorization = f"Bearer {secret}".encode()
    app.middleware("http")(_check_secret)
    app.include_router(router)
    return app


async def _check_secret(request: Request, call_next):
    """401 for a request to a guarded path without the shared secret."""
    if request.url.path in _OPEN_PATHS:
        return await call_next(request)
    given = request.headers.get("authorization", "").encode()
    if not hmac.compare_digest(given, request.app.state.expected_authorization):
        return JSONResponse({"message": "bad engine secret"}, status_code=401)
    return await call_next(request)


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
    if h["state"] == READY:
        return {"status": "ready", "engine": h}
    return JSONResponse({"status": "not_ready", "reason": f"the engine is {h['state']}", "engine": h},
                        status_code=503)


@router.get("/internal/info")
async def info(request: Request):
    aengine = _engine(request)
    return {"model": aengine.engine.model_config.name, "max_model_len": aengine.engine.max_model_len,
            "alive": aengine.is_alive, "state": aengine.state}


@router.post("/internal/generate")
async def generate(request: Request):
    try:
        req = _generation_request(await request.json())
    except InvalidRequestError as e:
        return JSONResponse({"message": e.message, "param": e.param}, status_code=400)
    except (KeyError, TypeError, ValueError) as e:
        return JSONResponse({"message": f"malformed internal request: {e}", "param": None}, status_code=400)
    stream = _engine(request).generate(req)
    try:
        first = await stream.__anext__()  # surfaces a refusal as a status code, not mid-stream
    except InvalidRequestError as e:
        return JSONResponse({"message": e.message, "param": e.param}, status_code=400)
    except EngineDeadError as e:
        return JSONResponse({"message": str(e), "param": None}, status_code=503)
    return DisconnectAwareStream(_ndjson_lines(first, stream), media_type="application/x-ndjson")


def _generation_request(body: dict) -> GenerationRequest:
    """The GenerationRequest a /internal/generate body describes (InvalidRequestError, KeyError,
    TypeError or ValueError when it is malformed)."""
    return GenerationRequest(
        request_id=str(body["request_id"]), prompt_token_ids=list(body["prompt_token_ids"]),
        params=SamplingParams.from_dict(body.get("params") or {}), tenant_id=str(body.get("tenant_id", "default")),
        priority=Priority.parse(body.get("priority", "standard")), adapter=body.get("adapter"))


async def _ndjson_lines(first, stream):
    """`first` and the rest of `stream`, one JSON line each; a line {"engine_dead"} if the engine
    dies mid-request. Closing the stream aborts the request if it did not finish."""
    try:
        yield (json.dumps(vars(first)) + "\n").encode()
        if first.finished:
            return
        async for out in stream:
            yield (json.dumps(vars(out)) + "\n").encode()
    except EngineDeadError as e:
        yield (json.dumps({"engine_dead": str(e)}) + "\n").encode()
    finally:
        await stream.aclose()  # aborts the request if it did not finish
