"""Usage in time buckets (tessera.usage_query), for tenants and for admins.

  GET /v1/usage                                  the calling tenant's usage (API key)
  GET /admin/v1/tenants/{tenant}/usage/buckets   any tenant's usage (admin)

Query: start_time (unix seconds, inclusive, required), end_time (exclusive), bucket_width 1h|1d
(default 1d), group_by (repeatable, or comma-separated: adapter, priority, api_key, end_user), limit
(buckets per page), page (the previous answer's next_page). The answer's shape is in
tessera/usage_query.py. A bad parameter is a 400 naming it.
"""
from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from tessera.api import response_models as out
from tessera.api.deps import PathTenant, run_db
from tessera.auth import AdminDep, CallerDep, GatewayDep
from tessera.errors import ApiError
from tessera.usage_query import UsageQueryError, usage_buckets

router = APIRouter()


def _query(session, tenant_id: int, start_time: int | None, end_time: int | None, bucket_width: str,
           group_by: list[str] | None, limit: int | None, page: str | None, currency: str = "USD") -> dict:
    if start_time is None:
        raise ApiError(400, "start_time is required (unix seconds, inclusive)", param="start_time")
    groups = [g.strip() for item in (group_by or []) for g in item.split(",") if g.strip()]
    try:
        return usage_buckets(session=session, tenant_id=tenant_id, start_time=start_time, end_time=end_time,
                             bucket_width=bucket_width, group_by=groups, limit=limit, page=page,
                             currency=currency)
    except UsageQueryError as e:
        raise ApiError(400, str(e), param=e.param) from None


GroupBy = Annotated[list[str] | None, Query()]


@router.get("/v1/usage", response_model=out.UsagePage, response_model_exclude_unset=True)
async def tenant_usage(caller: CallerDep, gw: GatewayDep, start_time: int | None = None, end_time: int | None = None,
                       bucket_width: str = "1d", group_by: GroupBy = None, limit: int | None = None,
                       page: str | None = None):
    """The calling tenant's usage: tokens and requests per time bucket."""
    return await run_db(gw, lambda s: _query(s, caller.tenant_id, start_time, end_time, bucket_width, group_by, limit, page,
                                              gw.settings.billing_currency),
                     changes=False)


@router.get("/admin/v1/tenants/{tenant}/usage/buckets", response_model=out.UsagePage, response_model_exclude_unset=True)
async def admin_usage(_: AdminDep, tenant: PathTenant, gw: GatewayDep, start_time: int | None = None,
                      end_time: int | None = None, bucket_width: str = "1d", group_by: GroupBy = None,
                      limit: int | None = None, page: str | None = None):
    """A tenant's usage for admins: the same query and answer as GET /v1/usage."""
    return await run_db(gw, lambda s: _query(s, tenant.id, start_time, end_time, bucket_width, group_by, limit, page,
                                             gw.settings.billing_currency),
                        changes=False)
