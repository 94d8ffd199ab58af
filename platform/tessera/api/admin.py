"""The minimal admin API (Bearer admin token): plans, tenants, API keys, quotas, usage totals.

  PUT    /admin/v1/plans/{name}                      create or update a plan
  POST   /admin/v1/tenants                           create a tenant on a plan
  POST   /admin/v1/tenants/{tenant}/keys             issue a key (the key is in this answer only)
  DELETE /admin/v1/tenants/{tenant}/keys/{key_id}    revoke a key (effective on the next request)
  PATCH  /admin/v1/tenants/{tenant}/quotas           change the plan / override limits (null clears)
  GET    /admin/v1/tenants/{tenant}/usage            usage totals by status
"""
from __future__ import annotations

from typing import Any

import anyio
from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import func, select
from sqlalchemy.exc import DataError, SQLAlchemyError

from adapter_registry import services as registry
from adapter_registry.errors import RegistryError
from tessera import services
from tessera.api.bounds import Int32, Int64, RowId
from tessera.auth import AdminDep, GatewayDep
from tessera.errors import ApiError
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


class TenantIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    plan: str | None = None  # None: the settings' default_plan


class KeyIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str | None = Field(None, max_length=64)


class QuotasIn(Limits):
    plan: str | None = None


def _policy_dict(p: services.Policy) -> dict:
    return {"plan": p.plan, **p.limits.__dict__, "allowed_priorities": list(p.allowed_priorities),
            "default_priority": p.default_priority}


async def _db(gw, fn, *, changes: bool = True) -> Any:
    """Run fn(session) on a thread; registry errors and bad values become OpenAI-shaped errors.
    After a change the configuration epoch is bumped: every gateway drops its cached callers."""

    def run():
        with gw.session_factory() as session:
            return fn(session)

    try:
        result = await anyio.to_thread.run_sync(run)
        if changes:
            await gw.epoch.bump()
        return result
    except RegistryError as e:
        raise ApiError(e.http_status, str(e)) from None
    except (ValueError, OverflowError, DataError) as e:
        # DataError: a value the database refuses (out of its column's range); not an outage.
        raise ApiError(400, str(e.orig) if isinstance(e, DataError) else str(e)) from None
    except SQLAlchemyError:
        raise ApiError(503, "the database is unavailable; try again") from None


@router.put("/plans/{name}")
async def put_plan(name: str, body: PlanIn, _: AdminDep, gw: GatewayDep):
    fields = body.model_dump(exclude_unset=True)

    def run(session):
        plan = services.upsert_plan(session=session, name=name, **fields)
        return {"name": plan.name, **{f: getattr(plan, f) for f in services.LIMIT_FIELDS},
                "allowed_priorities": plan.allowed_priorities, "default_priority": plan.default_priority,
                "monthly_included_tokens": plan.monthly_included_tokens}

    return await _db(gw, run)


@router.post("/tenants", status_code=201)
async def create_tenant(body: TenantIn, _: AdminDep, gw: GatewayDep):
    def run(session):
        t = services.create_tenant(session=session, name=body.name, plan=body.plan or gw.settings.default_plan)
        return {"id": t.id, "name": t.name,
                "policy": _policy_dict(services.policy_for(session=session, tenant_id=t.id))}

    return await _db(gw, run)


@router.post("/tenants/{tenant}/keys", status_code=201)
async def issue_key(tenant: str, body: KeyIn, _: AdminDep, gw: GatewayDep):
    def run(session):
        t = registry.get_tenant(session=session, name=tenant)
        row, key = services.issue_key(session=session, tenant=t, name=body.name)
        return {"id": row.id, "tenant": t.name, "name": row.name, "prefix": row.prefix, "key": key}

    return await _db(gw, run)


@router.delete("/tenants/{tenant}/keys/{key_id}")
async def revoke_key(tenant: str, key_id: RowId, _: AdminDep, gw: GatewayDep):
    def run(session):
        t = registry.get_tenant(session=session, name=tenant)
        row = services.revoke_key(session=session, tenant=t, key_id=key_id)
        return {"id": row.id, "revoked_at": row.revoked_at.isoformat()}

    return await _db(gw, run)


@router.patch("/tenants/{tenant}/quotas")
async def set_quotas(tenant: str, body: QuotasIn, _: AdminDep, gw: GatewayDep):
    values = body.model_dump(exclude_unset=True)
    plan = values.pop("plan", None)

    def run(session):
        t = registry.get_tenant(session=session, name=tenant)
        return _policy_dict(services.set_policy(session=session, tenant=t, plan=plan, values=values))

    return await _db(gw, run)


@router.get("/tenants/{tenant}/usage")
async def usage(tenant: str, _: AdminDep, gw: GatewayDep):
    def run(session):
        t = registry.get_tenant(session=session, name=tenant)
        rows = session.execute(
            select(UsageEvent.status, func.count(), func.coalesce(func.sum(UsageEvent.prompt_tokens), 0),
                   func.coalesce(func.sum(UsageEvent.completion_tokens), 0))
            .where(UsageEvent.tenant_id == t.id).group_by(UsageEvent.status)).all()
        return {"tenant": t.name, "by_status": {s: {"requests": n, "prompt_tokens": int(p), "completion_tokens": int(c)}
                                                for s, n, p, c in rows}}

    return await _db(gw, run, changes=False)
