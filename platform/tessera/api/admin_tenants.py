"""Admin API for reading and running tenants (Bearer admin token, or the web UI's session).

  GET    /admin/v1/plans                         plans and the priority classes there are
  GET    /admin/v1/tenants                       every tenant with status, effective policy, overrides
  GET    /admin/v1/tenants/{tenant}              one tenant, the same shape
  PATCH  /admin/v1/tenants/{tenant}              {"status": "suspended" | "active"}
  GET    /admin/v1/tenants/{tenant}/keys         its keys: id, name, prefix, created_at, revoked_at

Plans, quotas and priorities are changed with PUT /admin/v1/plans/{name} and PATCH
/admin/v1/tenants/{tenant}/quotas (api/admin.py); keys are issued and revoked there too.
Suspending bumps the configuration epoch, so every gateway refuses the tenant's keys (403) on
the next request.
"""
from __future__ import annotations

from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict
from sqlalchemy import func, select

from adapter_registry.errors import NotFound
from adapter_registry.models import Adapter
from tessera import services
from tessera.api import response_models as out
from tessera.api.admin_views import iso, plan_dict, policy_dict
from tessera.api.deps import PathTenant, attach, run_db
from tessera.auth import AdminDep, GatewayDep
from tessera.models import PRIORITIES, ApiKey

router = APIRouter(prefix="/admin/v1")


class TenantPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    status: Literal["active", "suspended"]


def _tenant_dict(session, tenant) -> dict:
    active_keys = session.scalar(select(func.count(ApiKey.id)).where(
        ApiKey.tenant_id == tenant.id, ApiKey.revoked_at.is_(None)))
    adapters = session.scalar(select(func.count(Adapter.id)).where(
        Adapter.tenant_id == tenant.id, Adapter.deleted_at.is_(None)))
    return {"id": tenant.id, "name": tenant.name, "status": tenant.status, "created_at": iso(tenant.created_at),
            "policy": policy_dict(services.policy_for(session=session, tenant_id=tenant.id)),
            "overrides": services.tenant_overrides(session=session, tenant=tenant),
            "active_keys": active_keys, "adapters": adapters}


@router.get("/plans", response_model=out.PlanList)
async def list_plans(_: AdminDep, gw: GatewayDep):
    def run(session):
        return {"data": [plan_dict(p) for p in services.list_plans(session=session)],
                "priority_classes": list(PRIORITIES), "default_plan": gw.settings.default_plan}

    return await run_db(gw, run, changes=False)


@router.get("/tenants", response_model=out.TenantList)
async def list_tenants(_: AdminDep, gw: GatewayDep):
    def run(session):
        # A tenant made by the registry alone (CLI upload) has no plan yet: list it without one.
        rows = []
        for t in services.list_tenants(session=session):
            try:
                rows.append(_tenant_dict(session, t))
            except NotFound:
                rows.append({"id": t.id, "name": t.name, "status": t.status, "created_at": iso(t.created_at),
                             "policy": None, "overrides": None, "active_keys": 0, "adapters": 0})
        return {"data": rows}

    return await run_db(gw, run, changes=False)


@router.get("/tenants/{tenant}", response_model=out.Tenant)
async def get_tenant(_: AdminDep, tenant: PathTenant, gw: GatewayDep):
    def run(session):
        return _tenant_dict(session, tenant)

    return await run_db(gw, run, changes=False)


@router.patch("/tenants/{tenant}", response_model=out.Tenant)
async def patch_tenant(_: AdminDep, tenant: PathTenant, body: TenantPatch, gw: GatewayDep):
    def run(session):
        t = attach(session, tenant)
        services.set_tenant_status(session=session, tenant=t, status=body.status)
        return _tenant_dict(session, t)

    return await run_db(gw, run)


@router.get("/tenants/{tenant}/keys", response_model=out.ApiKeyList)
async def list_keys(_: AdminDep, tenant: PathTenant, gw: GatewayDep):
    def run(session):
        return {"tenant": tenant.name, "data": [
            {"id": k.id, "name": k.name, "prefix": k.prefix, "created_at": iso(k.created_at),
             "revoked_at": iso(k.revoked_at)} for k in services.list_keys(session=session, tenant=tenant)]}

    return await run_db(gw, run, changes=False)
