"""Admin billing API (Bearer admin token, or the web UI's session). Money is in integer
micro-units of the platform's currency (`*_micros`), exact line amounts in picos (1e-12).
Token kinds: input, cached_input, output; `input_tokens` count every prompt token and
`cached_input_tokens` those of them the prefix cache served (see tessera.billing.models).

  GET  /admin/v1/billing/prices[?tenant=T]              the book (and T's contract prices), base models
  PUT  /admin/v1/billing/prices                         set one price (tenant: null = the book)
  POST /admin/v1/billing/rollup                         roll usage up now; reports held usage
  GET  /admin/v1/billing/held[?tenant=T]                pending usage without a price
  GET  /admin/v1/tenants/{t}/billing/periods            months with usage: open or closed, totals
  GET  /admin/v1/tenants/{t}/billing/periods/{YYYY-MM}  one month: invoice (if closed) + line items
  POST /admin/v1/tenants/{t}/billing/periods/{YYYY-MM}/close     roll up, close into an invoice
  POST /admin/v1/tenants/{t}/billing/periods/{YYYY-MM}/exports   {"format": csv|parquet|jsonl}
  GET  /admin/v1/tenants/{t}/billing/exports[?period=YYYY-MM]    exports written so far
  GET  /admin/v1/billing/exports/{id}/download          the file

An export runs inline in the embedded mode (201, the export's record) and on a Celery worker
otherwise (202 with the task id; it appears in the exports list when written).
"""
from __future__ import annotations

import tempfile
from datetime import date
from decimal import Decimal
from pathlib import Path
from typing import Literal

import anyio
from fastapi import APIRouter
from fastapi.responses import FileResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select
from starlette.background import BackgroundTask

from adapter_registry import services as registry
from adapter_registry.errors import NotFound
from adapter_registry.models import Tenant
from engine.sampling_params import PRIORITY_NAMES
from tessera.api import response_models as out
from tessera.api.bounds import MAX_PRICE_MICROS, RowId
from tessera.api.deps import PathTenant, run_db
from tessera.auth import AdminDep, GatewayDep
from tessera.billing import jobs
from tessera.billing.exports import CONTENT_TYPES, download_name, fetch_export, list_exports
from tessera.billing.invoices import list_periods, period_summary, round_picos
from tessera.billing.models import TOKEN_KINDS, Export, Invoice, LineItem, Price
from tessera.billing.periods import Period, PeriodError
from tessera.billing.prices import list_prices, set_price
from tessera.billing.rollup import held_usage
from tessera.errors import ApiError
from tessera_core.context import Context

router = APIRouter(prefix="/admin/v1")


class PriceIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    base_model: str = Field(min_length=1, max_length=200)
    priority: Literal[PRIORITY_NAMES]  # type: ignore[valid-type]  # one of the engine's classes
    token_kind: Literal[TOKEN_KINDS]  # type: ignore[valid-type]  # cached_input: prompt tokens the prefix cache served
    micros_per_mtok: int = Field(ge=0, le=MAX_PRICE_MICROS, description="micro-units of the currency per million tokens")
    effective_from: date
    tenant: str | None = None  # a contract price of this tenant; None: the book


class ExportIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: Literal["csv", "parquet", "jsonl"]


def _ctx(gw) -> Context:
    return Context(gw.settings, gw.db, gw.session_factory, gw.store)


def _period(name: str) -> Period:
    try:
        return Period.parse(name)
    except PeriodError as e:
        raise ApiError(400, str(e), param="period") from None


def _money(micros: int | None) -> str | None:
    """Micro-units as an exact decimal string of currency units ('12.345678')."""
    return None if micros is None else f"{Decimal(micros).scaleb(-6):.6f}"


def _price(p: Price, tenant_names: dict[int, str]) -> dict:
    return {"id": p.id, "tenant": tenant_names.get(p.tenant_id) if p.tenant_id else None, "base_model": p.base_model,
            "priority": p.priority, "token_kind": p.token_kind, "micros_per_mtok": p.micros_per_mtok,
            "effective_from": p.effective_from.isoformat(), "created_at": p.created_at.isoformat()}


def _invoice(i: Invoice, tenant: str) -> dict:
    return {"id": i.id, "tenant": tenant, "period": Period(i.period_start).name, "status": "closed",
            "period_start": i.period_start.isoformat(), "period_end": i.period_end.isoformat(), "currency": i.currency,
            "line_items": i.line_items, "requests": i.requests, "input_tokens": i.input_tokens,
            "cached_input_tokens": i.cached_input_tokens, "output_tokens": i.output_tokens,
            "subtotal_micros": i.subtotal_micros,
            "allowance_tokens": i.allowance_tokens, "allowance_used_tokens": i.allowance_used_tokens,
            "allowance_credit_micros": i.allowance_credit_micros, "total_micros": i.total_micros,
            "total": _money(i.total_micros), "held": i.held, "closed_at": i.closed_at.isoformat()}


def _line_item(li: LineItem) -> dict:
    status = "invoiced" if li.invoice_id is not None else ("held" if li.amount_picos is None else "pending")
    return {"usage_day": li.usage_day.isoformat(), "base_model": li.base_model, "adapter": li.adapter or None,
            "priority": li.priority, "requests": li.requests, "input_tokens": li.input_tokens,
            "cached_input_tokens": li.cached_input_tokens, "output_tokens": li.output_tokens,
            "input_price_micros_per_mtok": li.input_price, "cached_input_price_micros_per_mtok": li.cached_input_price,
            "output_price_micros_per_mtok": li.output_price, "amount_picos": li.amount_picos,
            # The same exact amount as a string of currency units: JSON numbers past 2^53 lose
            # digits in JavaScript and other clients.
            "amount": None if li.amount_picos is None else f"{Decimal(li.amount_picos).scaleb(-12):.12f}",
            "amount_micros": None if li.amount_picos is None else round_picos(li.amount_picos), "status": status}


def _export(e: Export, tenant: str) -> dict:
    return {"id": e.id, "tenant": tenant, "period": Period(e.period_start).name, "format": e.format, "rows": e.rows,
            "size_bytes": e.size_bytes, "sha256": e.sha256, "final": e.final, "created_at": e.created_at.isoformat(),
            "filename": download_name(tenant, e.period_start, e.format),
            "download_url": f"/admin/v1/billing/exports/{e.id}/download"}


@router.get("/billing/prices", response_model=out.PriceBook)
async def get_prices(_: AdminDep, gw: GatewayDep, tenant: str | None = None):
    def run(session):
        tid = registry.get_tenant(session=session, name=tenant).id if tenant else None
        names = {t.id: t.name for t in session.scalars(select(Tenant))}
        return {"currency": gw.settings.billing_currency, "base_models": [gw.engine.model_name],
                "data": [_price(p, names) for p in list_prices(session=session, tenant_id=tid)]}

    return await run_db(gw, run, changes=False)


@router.put("/billing/prices", response_model=out.Price)
async def put_price(body: PriceIn, _: AdminDep, gw: GatewayDep):
    def run(session):
        t = registry.get_tenant(session=session, name=body.tenant) if body.tenant else None
        p = set_price(session=session, base_model=body.base_model, priority=body.priority, token_kind=body.token_kind,
                      micros_per_mtok=body.micros_per_mtok, effective_from=body.effective_from,
                      tenant_id=t.id if t else None)
        return _price(p, {t.id: t.name} if t else {})

    return await run_db(gw, run, changes=False)


@router.post("/billing/rollup", response_model=out.RollupReport)
async def post_rollup(_: AdminDep, gw: GatewayDep):
    return await run_db(gw, lambda _s: jobs.rollup_job(_ctx(gw)).as_dict(), changes=False)


@router.get("/billing/held", response_model=out.HeldUsageList)
async def get_held(_: AdminDep, gw: GatewayDep, tenant: str | None = None):
    def run(session):
        tid = registry.get_tenant(session=session, name=tenant).id if tenant else None
        return {"data": [h.__dict__ for h in held_usage(session.connection(), tenant_id=tid)]}

    return await run_db(gw, run, changes=False)


@router.get("/tenants/{tenant}/billing/periods", response_model=out.BillingPeriodList)
async def get_periods(_: AdminDep, tenant: PathTenant, gw: GatewayDep):
    def run(session):
        rows = []
        for p in list_periods(session, tenant_id=tenant.id):
            pending = p["pending"]
            if pending is not None:
                pending = {**pending, "amount_micros": round_picos(pending.pop("amount_picos"))}
            rows.append({"period": p["period"].name, "status": "closed" if p["invoice"] else "open",
                         "invoice": _invoice(p["invoice"], tenant.name) if p["invoice"] else None,
                         "pending": pending})
        return {"tenant": tenant.name, "currency": gw.settings.billing_currency, "data": rows}

    return await run_db(gw, run, changes=False)


@router.get("/tenants/{tenant}/billing/periods/{period}", response_model=out.BillingPeriod)
async def get_period(_: AdminDep, tenant: PathTenant, period: str, gw: GatewayDep):
    p = _period(period)

    def run(session):
        s = period_summary(session, tenant_id=tenant.id, period=p)
        items = [_line_item(li) for li in s["line_items"]]
        return {"tenant": tenant.name, "period": p.name, "status": "closed" if s["invoice"] else "open",
                "currency": gw.settings.billing_currency,
                "invoice": _invoice(s["invoice"], tenant.name) if s["invoice"] else None, "line_items": items,
                "message": None if items else f"no usage billed to {tenant.name} in {p.name}"}

    return await run_db(gw, run, changes=False)


@router.post("/tenants/{tenant}/billing/periods/{period}/close", response_model=out.Invoice)
async def close(_: AdminDep, tenant: PathTenant, period: str, gw: GatewayDep):
    p = _period(period)
    return await run_db(gw, lambda _s: _invoice(jobs.close_period_job(_ctx(gw), tenant_id=tenant.id, period=p),
                                                tenant.name), changes=False)


@router.post("/tenants/{tenant}/billing/periods/{period}/exports", status_code=201, response_model=out.BillingExport,
             responses={202: {"model": out.BillingExportQueued, "description": "Queued for a Celery worker"}})
async def create_export(_: AdminDep, tenant: PathTenant, period: str, body: ExportIn, gw: GatewayDep):
    p, tid = _period(period), tenant.id
    if not gw.settings.celery_eager:
        from tessera.billing.tasks import export_task

        try:
            result = await anyio.to_thread.run_sync(lambda: export_task.delay(tid, p.name, body.format))
        except Exception:  # noqa: BLE001 - broker down: say so, nothing was queued
            raise ApiError(503, "the task queue is unavailable; try again") from None
        return JSONResponse({"status": "queued", "task_id": result.id, "tenant": tenant.name, "period": p.name,
                             "format": body.format}, status_code=202)
    e = await run_db(gw, lambda _s: jobs.export_job(_ctx(gw), tenant_id=tid, period=p, fmt=body.format), changes=False)
    return JSONResponse(_export(e, tenant.name), status_code=201)


@router.get("/tenants/{tenant}/billing/exports", response_model=out.BillingExportList)
async def get_exports(_: AdminDep, tenant: PathTenant, gw: GatewayDep, period: str | None = None):
    p = _period(period) if period else None

    def run(session):
        return {"tenant": tenant.name,
                "data": [_export(e, tenant.name) for e in list_exports(session, tenant_id=tenant.id, period=p)]}

    return await run_db(gw, run, changes=False)


@router.get("/billing/exports/{export_id}/download", response_class=FileResponse, responses={200: {
    "description": "The export's file (x-content-sha256: its sha256)",
    "content": {media: {"schema": {"type": "string", "format": "binary"}} for media in CONTENT_TYPES.values()}}})
async def download(export_id: RowId, _: AdminDep, gw: GatewayDep):
    def run(session):
        e = session.get(Export, export_id)
        if e is None:
            raise NotFound(f"export {export_id} not found")
        return e, session.get(Tenant, e.tenant_id).name

    e, tenant = await run_db(gw, run, changes=False)
    tmp = tempfile.mkdtemp(prefix="tessera-download-")
    path = Path(tmp) / "file"
    try:
        await anyio.to_thread.run_sync(fetch_export, gw.store, e, path)
    except Exception:  # noqa: BLE001
        raise ApiError(503, "the export's file could not be read from the object store; try again") from None

    def cleanup():
        path.unlink(missing_ok=True)
        Path(tmp).rmdir()

    return FileResponse(path, media_type=CONTENT_TYPES[e.format], filename=download_name(tenant, e.period_start, e.format),
                        headers={"x-content-sha256": e.sha256}, background=BackgroundTask(cleanup))
