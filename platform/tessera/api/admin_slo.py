"""Admin API for per-tenant SLOs (Bearer admin token, or the web UI's session).

  GET    /admin/v1/slo                       every live tenant's SLO document (below), by name
  GET    /admin/v1/tenants/{tenant}/slo      one tenant's SLO document
  PATCH  /admin/v1/tenants/{tenant}/slo      override objectives (any subset; null = back to the plan's)
  GET    /admin/v1/plans/{plan}/slo          a plan's objectives (the defaults of its tenants)
  PUT    /admin/v1/plans/{plan}/slo          set a plan's objectives (any subset; null = built-in default)

PATCH/PUT body (every field optional):
  {"availability_target": 0.999, "ttft_threshold_ms": 500, "ttft_target": 0.95,
   "tpot_threshold_ms": 50, "tpot_target": 0.9}
Targets are shares strictly between 0 and 1; thresholds must be histogram bucket bounds
(ttft: 25 50 100 200 300 500 750 1000 1500 2000 3000 5000 10000 20000 60000 ms;
 tpot: 5 10 20 30 50 75 100 150 200 300 500 1000 ms); anything else is a 400 naming the field.

Plan routes answer {"plan": "pro", "objectives": {...effective, as below...}, "values": {field: value
or null (= built-in default)}}.

The SLO document (GET/PATCH of a tenant; GET /admin/v1/slo answers {"source", "tenants": [...]}):
  {"tenant": "acme", "plan": "pro",
   "objectives": {"availability": {"target": 0.995},
                  "ttft": {"threshold_ms": 1000, "target": 0.95},
                  "tpot": {"threshold_ms": 100, "target": 0.95}, "window_days": 30},
   "overrides": {"availability_target": null, "ttft_threshold_ms": 500, ...},   # null = inherited
   "source": "prometheus" | "usage_events",
   "status": {"availability" | "ttft" | "tpot": {
        "target": 0.995, "threshold_ms": null | 1000,
        "requests_30d": 1200 | null, "bad_30d": 3 | null,      # null when source is prometheus
        "error_ratio_30d": 0.0025 | null,                      # null: no request in 30 days
        "error_budget_remaining": 0.5,                         # 1 untouched, 0 spent, < 0 overspent
        "burn_rates": {"5m": 0.0, "30m": null, "1h": ..., "2h": ..., "6h": ..., "1d": ..., "3d": ...}}},
   "alerts": [{"alert": "TesseraErrorBudgetBurn", "slo": "ttft", "severity": "page" | "ticket",
               "long_window": "1h", "short_window": "5m", "burn_rate_threshold": 14.4,
               "state": "firing" | "pending"}]}
A burn rate is null when its window holds no request. The source is Prometheus (the recording
rules of `tessera slo rules`, and its active alerts) when TESSERA_PROMETHEUS_URL is set, and the
usage_events table otherwise; a configured Prometheus that cannot be reached falls back to the
usage events, with "source": "usage_events" and "source_error" saying why.
"""
from __future__ import annotations

import httpx
from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict

from tessera import services
from tessera.api import response_models as out
from tessera.api.bounds import Int32
from tessera.api.deps import PathTenant, attach, run_db
from tessera.auth import AdminDep, GatewayDep
from tessera.observability import slo

router = APIRouter(prefix="/admin/v1")


class ObjectivesIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    availability_target: float | None = None
    ttft_threshold_ms: Int32 | None = None
    ttft_target: float | None = None
    tpot_threshold_ms: Int32 | None = None
    tpot_target: float | None = None


def _document(t: slo.TenantObjectives, source: str, status: dict, alerts: list[dict]) -> dict:
    return {"tenant": t.tenant, "plan": t.plan, "objectives": t.objectives.as_api(), "overrides": t.overrides,
            "source": source, "status": status, "alerts": alerts}


async def _documents(gw, targets: list[slo.TenantObjectives]) -> tuple[list[dict], str | None]:
    """SLO documents of `targets`: from Prometheus when configured and reachable, else usage events."""
    url = gw.settings.prometheus_url
    error = None
    if url:
        try:
            async with httpx.AsyncClient(timeout=10) as client:
                found = await slo.status_from_prometheus(client, url, targets)
            return [_document(t, "prometheus", *found[t.tenant]) for t in targets], None
        except (httpx.HTTPError, KeyError, ValueError) as e:
            error = f"Prometheus at {url} could not be read ({type(e).__name__}); status computed from usage events"

    def run(session):
        docs = []
        for t in targets:
            status = slo.status_from_usage(session=session, tenant_id=t.tenant_id, objectives=t.objectives)
            burn = {name: s["burn_rates"] for name, s in status.items()}
            docs.append(_document(t, "usage_events", status, slo.firing(burn)))
        return docs

    docs = await run_db(gw, run, changes=False)
    if error:
        for d in docs:
            d["source_error"] = error
    return docs, error


@router.get("/slo", response_model=out.SloList, response_model_exclude_unset=True)
async def all_slos(_: AdminDep, gw: GatewayDep):
    targets = await run_db(gw, lambda s: slo.all_objectives(session=s), changes=False)
    docs, _err = await _documents(gw, targets)
    return {"source": docs[0]["source"] if docs else ("prometheus" if gw.settings.prometheus_url else "usage_events"),
            "tenants": docs}


@router.get("/tenants/{tenant}/slo", response_model=out.SloDocument, response_model_exclude_unset=True)
async def tenant_slo(_: AdminDep, tenant: PathTenant, gw: GatewayDep):
    def run(session):
        return slo.objectives_for(session=session, tenant=attach(session, tenant))

    docs, _err = await _documents(gw, [await run_db(gw, run, changes=False)])
    return docs[0]


@router.patch("/tenants/{tenant}/slo", response_model=out.SloDocument, response_model_exclude_unset=True)
async def set_tenant_slo(_: AdminDep, tenant: PathTenant, body: ObjectivesIn, gw: GatewayDep):
    values = body.model_dump(exclude_unset=True)

    def run(session):
        return slo.set_tenant_objectives(session=session, tenant=attach(session, tenant), values=values)

    docs, _err = await _documents(gw, [await run_db(gw, run)])
    return docs[0]


def _plan_doc(plan, objectives: slo.Objectives, own: dict) -> dict:
    return {"plan": plan.name, "objectives": objectives.as_api(), "values": own}


@router.get("/plans/{plan}/slo", response_model=out.PlanSlo)
async def plan_slo(plan: str, _: AdminDep, gw: GatewayDep):
    def run(session):
        p = services.get_plan(session=session, name=plan)
        return _plan_doc(p, *slo.plan_objectives(session=session, plan=p))

    return await run_db(gw, run, changes=False)


@router.put("/plans/{plan}/slo", response_model=out.PlanSlo)
async def set_plan_slo(plan: str, body: ObjectivesIn, _: AdminDep, gw: GatewayDep):
    values = body.model_dump(exclude_unset=True)

    def run(session):
        p = services.get_plan(session=session, name=plan)
        return _plan_doc(p, *slo.set_plan_objectives(session=session, plan=p, values=values))

    return await run_db(gw, run)
