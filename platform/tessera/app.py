"""`create_app(settings)`: the FastAPI application (tenant API + admin API) and its lifespan.

The lifespan builds the Gateway from settings: database + object store (the registry's context),
the engine client (in-process engine with the registry as its adapter source, or HTTP engine
workers), quota counters (Redis when configured, else in memory) and the usage meter. Tests and
the benchmark may pass an engine client (a shared engine) and a quota backend.
"""
from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from functools import partial

import anyio
from fastapi import Depends, FastAPI
from sqlalchemy import event

from adapter_registry.services import recover_stuck_versions_at_start
from tessera import admin_pages, auth
from tessera.api import (admin, admin_adapters, admin_billing, admin_slo, admin_tenants, body_text, openai, probes,
                         responses, usage)
from tessera.api.response_models import ERROR_RESPONSES
from tessera.billing.embedded import billing_loop
from tessera.engine_client import EngineClient
from tessera.epoch import make_epoch
from tessera.errors import ApiError, install_handlers
from tessera.gateway import Gateway
from tessera.metering import Meter
from tessera.observability import tracing
from tessera.observability.metrics import GatewayMetrics, RefusalCountingQuota
from tessera.quota import QuotaBackend, make_quota_backend
from tessera.settings import PlatformSettings, get_settings
from tessera_core.context import build_context

log = logging.getLogger(__name__)


def _sqlite_wal(db_engine) -> None:
    # Many concurrent readers + one writer at a time, and a commit without a full fsync of the
    # main file: usage inserts stay cheap in the embedded mode.
    @event.listens_for(db_engine, "connect")
    def _pragmas(dbapi_conn, _record):
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()


def build_engine_client(settings: PlatformSettings, ctx) -> EngineClient:
    """The engine client the settings ask for (loads the model when in-process)."""
    if settings.engine_mode == "http":
        from tessera.engine_client.http import HttpEngineClient

        return HttpEngineClient(settings.engine_urls, secret=settings.engine_secret.get_secret_value(),
                                model_path=settings.model_path, model_name=settings.model_name,
                                connect_timeout_s=settings.engine_connect_timeout_s,
                                read_timeout_s=settings.engine_read_timeout_s, poll_s=settings.engine_state_poll_s,
                                balance=settings.engine_route_balance)
    from adapter_registry.engine_source import RegistryAdapterSource
    from tessera.engine_client.inprocess import build_inprocess_client

    source = RegistryAdapterSource(session_factory=ctx.session_factory, store=ctx.store,
                                   cache_dir=settings.adapter_cache_dir)
    return build_inprocess_client(settings, adapter_source=source)


class BodyLimit:
    """Refuse request bodies over `max_bytes` with a 413: from Content-Length before reading, and
    for a body without one (chunked) by reading it up to the limit first, then replaying it.
    `large` lists (path regex, limit) pairs for routes that take bigger bodies (adapter uploads):
    only a request that `admin_gate(scope)` (headers only) passes gets that limit; any other is
    answered the gate's error (401/403/429) at once, before a byte of its body is read."""

    def __init__(self, app, max_bytes: int, large: tuple = (), admin_gate=None):
        self.app = app
        self.max_bytes = max_bytes
        self.large = large
        self.admin_gate = admin_gate

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        max_bytes = next((n for pattern, n in self.large if pattern.match(scope.get("path", ""))), self.max_bytes)
        if max_bytes != self.max_bytes and self.admin_gate is not None and scope.get("method") not in (
                "GET", "HEAD", "DELETE", "OPTIONS"):
            refused = await self.admin_gate(scope)
            if refused is not None:
                return await refused.response()(scope, receive, send)
        length = None
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                length = int(value) if value.isdigit() else None
        if length is not None:
            if length > max_bytes:
                return await self._too_big(max_bytes)(scope, receive, send)
            return await self.app(scope, receive, send)
        if scope.get("method") in ("GET", "HEAD", "DELETE", "OPTIONS"):
            return await self.app(scope, receive, send)
        # No Content-Length: buffer (at most max_bytes) so the limit holds before the app parses.
        messages, seen = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            seen += len(message.get("body", b""))
            if seen > max_bytes:
                return await self._too_big(max_bytes)(scope, receive, send)
            if not message.get("more_body"):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    @staticmethod
    def _too_big(max_bytes: int):
        return ApiError(413, f"request body is larger than {max_bytes} bytes", code="request_too_large").response()


def _lifespan(settings: PlatformSettings, engine_client: EngineClient | None, quota: QuotaBackend | None):
    """The app's lifespan: build the Gateway (see the module docstring), run the background jobs
    (usage outbox drain, embedded billing, recovery of versions left 'validating'), and close
    what it built (not the clients passed in)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        ctx = build_context(settings)
        if ctx.engine.dialect.name == "sqlite":
            _sqlite_wal(ctx.engine)
        client = engine_client or await anyio.to_thread.run_sync(build_engine_client, settings, ctx)
        await client.start()
        try:  # TESSERA_BASE_MODEL_ALIASES must name the model the engine serves (once it said which)
            if getattr(client, "base_model", None) is not None:
                settings.serving([client.base_model])
        except ValueError:
            if engine_client is None:
                await client.close()
            raise
        q = quota or make_quota_backend(settings.redis_url, key_prefix=settings.redis_key_prefix)
        metrics = GatewayMetrics(ctx.session_factory, max_tenant_labels=settings.metrics_max_tenant_labels,
                                 adapter_labels=settings.metrics_adapter_labels,
                                 max_adapter_labels=settings.metrics_max_adapter_labels)
        epoch = make_epoch(settings.redis_url, key_prefix=settings.redis_key_prefix)
        meter = Meter(ctx.engine, ctx.session_factory, observer=metrics.observe, outbox_dir=settings.usage_outbox_dir)
        app.state.gateway = Gateway(settings=settings, db=ctx.engine, session_factory=ctx.session_factory,
                                    store=ctx.store, engine=client, quota=RefusalCountingQuota(q, metrics),
                                    meter=meter, epoch=epoch)
        try:
            async with anyio.create_task_group() as tg:
                # Usage the database could not take (this process's, and what a dead one left).
                tg.start_soon(partial(meter.drain_outbox, retry_max_s=settings.usage_outbox_retry_max_s))
                if settings.celery_eager:  # embedded: no Celery beat; the gateway runs billing on a timer
                    tg.start_soon(billing_loop, ctx)
                # Adapter versions a dead process left 'validating': validated again (or re-queued).
                tg.start_soon(partial(anyio.to_thread.run_sync, recover_stuck_versions_at_start, ctx,
                                      abandon_on_cancel=True))
                yield
                tg.cancel_scope.cancel()
        finally:
            await epoch.close()
            if quota is None:
                await q.close()
            if engine_client is None:
                await client.close()
            meter.close()
            ctx.engine.dispose()

    return lifespan


def create_app(settings: PlatformSettings | None = None, *, engine_client: EngineClient | None = None,
               quota: QuotaBackend | None = None) -> FastAPI:
    """The platform's ASGI app. Clients passed in are used as they are and not closed."""
    settings = settings or get_settings()
    otel = settings.otel_tracing
    app = FastAPI(title="Tessera", version="0.1.0", lifespan=_lifespan(settings, engine_client, quota),
                  telemetry={"tracing": otel, "metrics": otel, "logs": otel, "operation_spans": otel},
                  dependencies=[Depends(body_text.valid_unicode_body)],  # one check of every JSON body's text
                  responses=ERROR_RESPONSES)  # every route's 4xx/5xx: OpenAI's error shape
    app.state.settings = settings
    install_handlers(app)
    for api in (openai, admin, admin_tenants, admin_adapters, admin_slo, admin_billing, usage):
        app.include_router(api.router)
    app.include_router(responses.router)  # /v1/responses: OpenAI's Responses API, run as chat
    admin_pages.mount(app)  # the web UI at /admin (sign-in, pages, assets)
    app.include_router(probes.router)  # /health, /ready, /metrics
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes,
                       large=((admin_adapters.UPLOAD_PATH, settings.max_upload_bytes),), admin_gate=auth.admin_gate)
    if settings.tracing:  # outermost: the server span covers every refusal too
        tracing.setup("tessera-gateway")
        app.add_middleware(tracing.ServerSpans)
    return app
