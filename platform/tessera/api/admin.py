"""The minimal admin API (Bearer admin token): plans, tenants, API keys, quotas, usage totals.

  PUT    /admin/v1/plans/{name}                      create or update a plan
  POST   /admin/v1/tenants                           create a tenant on a plan
  POST   /admin/v1/tenants/{tenant}/keys             issue a key (the key is in this answer only)
  DELETE /admin/v1/tenants/{tenant}/keys/{key_id}    revoke a key (effective on the next request)
  PATCH  /admin/v1/tenants/{tenant}/quotas           change the plan / override limits (null clears)
  GET    /admin/v1/tenants/{tenant}/usage            usage totals by status

Every answer's shape is declared in api/response_models.py (the OpenAPI document shows it).
"""
from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import func, select

from engine.scheduler import MAX_TENANT_WEIGHT
from tessera import services
from tessera.api import response_models as out
from tessera.api.admin_views import plan_dict, policy_dict
from tessera.api.bounds import Int32, Int64, RowId
from tessera.api.deps import PathTenant, attach, run_db
from tessera.auth import AdminDep, GatewayDep
from tessera.models import UsageEvent

router = APIRouter(prefix="/admin/v1")


class Limits(BaseModel):
    model_config = ConfigDict(extra="forbid")
    requests_per_minute: Int32 | None = None
    tokens_per_minute: Int64 | None = None
    max_concurrent_requests: Int32 | None = None
    monthly_token_budget: Int64 | None = None
    allowed_priorities: list[str] | None = None
    default_priority: str | None = None


class PlanIn(Limits):
    monthly_included_tokens: Int64 | None = None  # billing: tokens a month at no charge
    # Its tenants' weight in the engine's fair shares inside a priority class (engine.scheduler).
    scheduling_weight: float | None = Field(None, gt=0, le=MAX_TENANT_WEIGHT, allow_inf_nan=False)


class TenantIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    plan: str | None = None  # None: the settings' default_plan


class KeyIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str | None = Field(None, max_length=64)


class QuotasIn(Limits):
    plan: str | None = None


@router.put("/plans/{name}", response_model=out.Plan)
async def put_plan(name: str, body: PlanIn, _: AdminDep, gw: GatewayDep):
    fields = body.model_dump(exclude_unset=True)

    def run(session):
        return plan_dict(services.upsert_plan(session=session, name=name, **fields))

    return await run_db(gw, run)


@router.post("/tenants", status_code=201, response_model=out.TenantCreated)
async def create_tenant(body: TenantIn, _: AdminDep, gw: GatewayDep):
    def run(session):
        t = services.create_tenant(session=session, name=body.name, plan=body.plan or gw.settings.default_plan)
        return {"id": t.id, "name": t.name,
                "policy": policy_dict(services.policy_for(session=session, tenant_id=t.id))}

    return await run_db(gw, run)


@router.post("/tenants/{tenant}/keys", status_code=201, response_model=out.ApiKeyIssued)
async def issue_key(_: AdminDep, tenant: PathTenant, body: KeyIn, gw: GatewayDep):
    def run(session):
        t = attach(session, tenant)
        row, key = services.issue_key(session=session, tenant=t, name=body.name)
        return {"id": row.id, "tenant": t.name, "name": row.name, "prefix": row.prefix, "key": key}

    return await run_db(gw, run)


@router.delete("/tenants/{tenant}/keys/{key_id}", response_model=out.ApiKeyRevoked)
async def revoke_key(_: AdminDep, tenant: PathTenant, key_id: RowId, gw: GatewayDep):
    def run(session):
        row = services.revoke_key(session=session, tenant=attach(session, tenant), key_id=key_id)
        return {"id": row.id, "revoked_at": row.revoked_at.isoformat()}

    return await run_db(gw, run)


@router.patch("/tenants/{tenant}/quotas", response_model=out.Policy)
async def set_quotas(_: AdminDep, tenant: PathTenant, body: QuotasIn, gw: GatewayDep):
    values = body.model_dump(exclude_unset=True)
    plan = values.pop("plan", None)

    def run(session):
        return policy_dict(services.set_policy(session=session, tenant=attach(session, tenant), plan=plan,
                                               values=values))

    return await run_db(gw, run)


@router.get("/tenants/{tenant}/usage", response_model=out.TenantUsageTotals)
async def usage(_: AdminDep, tenant: PathTenant, gw: GatewayDep):
    def run(session):
        rows = session.execute(
            select(UsageEvent.status, func.count(), func.coalesce(func.sum(UsageEvent.prompt_tokens), 0),
                   func.coalesce(func.sum(UsageEvent.completion_tokens), 0))
            .where(UsageEvent.tenant_id == tenant.id).group_by(UsageEvent.status)).all()
        return {"tenant": tenant.name, "by_status": {s: {"requests": n, "prompt_tokens": int(p), "completion_tokens": int(c)}
                                                for s, n, p, c in rows}}

    return await run_db(gw, run, changes=False)
