"""The gateway's operational routes, for load balancers and Prometheus (no tenant data, no key):

  GET /health    liveness: 200 whenever the process answers; `engine` is the engine's real state
  GET /ready     readiness: 200 when a request sent now would find an engine (in process: its
                 state is "ready"; HTTP mode: an engine worker answered its /ready recently),
                 else 503 with the reason
  GET /metrics   Prometheus exposition of this gateway (all workers' values in multiprocess
                 mode), as tessera.observability.exposure allows: not here when it has a port of
                 its own, Bearer TESSERA_METRICS_TOKEN when that is set, else only for an
                 embedded gateway on loopback (its series name every tenant)
"""
from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from tessera.api import response_models as out
from tessera.observability import exposure
from tessera.observability.metrics import render as render_metrics

router = APIRouter()


async def engine_readiness(request: Request) -> dict:
    """The engine client's readiness (EngineClient.ready) as JSON; "starting" before the
    lifespan built the gateway, "unknown" for a client that cannot tell."""
    gateway = getattr(request.app.state, "gateway", None)
    if gateway is None:
        return {"ready": False, "state": "starting", "reason": "the gateway is starting"}
    ready = getattr(gateway.engine, "ready", None)
    if ready is None:
        return {"ready": True, "state": "unknown", "reason": None}
    r = await ready()
    return {"ready": r.ready, "state": r.state, "reason": r.reason, "restarts": r.restarts,
            **({"engines": r.engines} if r.engines else {})}


@router.get("/health", response_model=out.Health, response_model_exclude_unset=True)
async def health(request: Request):
    """Liveness: 200 whenever the process answers; `engine` says the engine's real state."""
    return {"status": "ok", "engine": await engine_readiness(request)}


@router.get("/ready", include_in_schema=False)
async def ready(request: Request):
    """Readiness: 200 when a request sent now would find an engine, else 503 with the reason."""
    engine = await engine_readiness(request)
    if engine["ready"]:
        return {"status": "ready", "engine": engine}
    return JSONResponse({"status": "not_ready", "reason": engine["reason"], "engine": engine}, status_code=503)


@router.get("/metrics", include_in_schema=False)
async def prometheus_metrics(request: Request):
    """Prometheus exposition of this gateway (all workers' values in multiprocess mode)."""
    refused = exposure.refusal(request.app.state.settings, request.headers.get("authorization", ""))
    if refused is not None:
        raise refused
    body, content_type = render_metrics()
    return Response(body, media_type=content_type)
