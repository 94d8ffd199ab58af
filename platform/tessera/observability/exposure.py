"""Who may read a gateway's /metrics. Its series are labelled by tenant name, so the tenant port
must not show them to anyone who can reach it.

The rule (`refusal`):
- TESSERA_METRICS_PORT set: /metrics is served on that port (`start_listener`, one per `tessera
  serve`: with --workers N the supervising process answers with every worker's values) and the
  tenant port answers 404 for it;
- else TESSERA_METRICS_TOKEN set: the tenant port serves it to `Authorization: Bearer <token>`
  only (401 otherwise);
- else it is open on the tenant port only for an embedded gateway (SQLite, engine in process)
  listening on loopback (`tessera demo`, a laptop's `tessera serve`); any other gateway (the
  scale-out form: Postgres or engine workers over HTTP, or a non-loopback address) answers 404
  saying which setting to use.
The metrics port applies the token too when one is set. Engine workers' /metrics carries no
tenant names and stays open on their port (engine_client/worker.py).
"""
from __future__ import annotations

import hmac
import ipaddress
import logging
import threading

from tessera.errors import ApiError

log = logging.getLogger(__name__)


def is_embedded_on_loopback(settings) -> bool:
    """True for the embedded form (SQLite, engine in this process) listening on a loopback
    address: only this machine's users reach its port."""
    if settings.engine_mode != "inprocess" or not settings.database_url.startswith("sqlite"):
        return False
    if settings.host == "localhost":
        return True
    try:
        return ipaddress.ip_address(settings.host).is_loopback
    except ValueError:  # a host name: not known to be loopback
        return False


def _token_refusal(settings, authorization: str) -> ApiError | None:
    token = settings.metrics_token
    if token is None or hmac.compare_digest(authorization.encode(), f"Bearer {token.get_secret_value()}".encode()):
        return None
    return ApiError(401, "/metrics needs the metrics token (TESSERA_METRICS_TOKEN)", code="invalid_metrics_token")


def refusal(settings, authorization: str, *, metrics_port: bool = False) -> ApiError | None:
    """Why this request may not read /metrics (an ApiError to answer), or None when it may.
    `metrics_port`: the request came to the metrics port, not the tenant port."""
    if not metrics_port:
        if settings.metrics_port is not None:
            return ApiError(404, "no such endpoint", code="unknown_url")
        if settings.metrics_token is None and not is_embedded_on_loopback(settings):
            return ApiError(404, "/metrics is not served on the tenant port of this gateway: set "
                                 "TESSERA_METRICS_PORT (a port of its own) or TESSERA_METRICS_TOKEN (Bearer token)",
                            code="metrics_not_exposed")
    return _token_refusal(settings, authorization)


def _metrics_app(settings):
    """The metrics port's ASGI app: GET /metrics (render(), every worker's values in multiprocess
    mode) behind the token when one is set; 404 for anything else."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from tessera.observability.metrics import render

    async def metrics(request: Request):
        refused = refusal(settings, request.headers.get("authorization", ""), metrics_port=True)
        if refused is not None:
            return refused.response()
        body, content_type = render()
        return Response(body, media_type=content_type)

    return Starlette(routes=[Route("/metrics", metrics, methods=["GET"])])


def start_listener(settings):
    """Serve /metrics on settings.metrics_port (settings.host) in a daemon thread of this process,
    with the HTTP connection rules of every server (tessera.http_server); returns the
    uvicorn.Server. The caller has checked that the port is free."""
    import uvicorn

    from tessera.http_server import server_options

    config = uvicorn.Config(_metrics_app(settings), host=settings.host, port=settings.metrics_port,
                            log_level="warning", lifespan="off", **server_options(settings))
    server = uvicorn.Server(config)
    # Not the main thread: uvicorn installs no signal handlers; the process's exit ends it.
    threading.Thread(target=server.run, name="metrics-listener", daemon=True).start()
    log.info("serving /metrics on %s:%d", settings.host, settings.metrics_port)
    return server
