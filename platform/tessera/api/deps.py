"""Dependencies shared by the admin routes, as types (`PathTenant`), and `run_db`, the one way a
route runs database work.

  PathTenant   the live tenant named by the route's `{tenant}` path parameter; 404 otherwise
  run_db       run fn(session) on a worker thread, registry and database errors as API errors
"""
from __future__ import annotations

from typing import Annotated, Any

import anyio
from fastapi import Depends
from sqlalchemy.exc import DataError, SQLAlchemyError
from sqlalchemy.orm import Session

from adapter_registry import services as registry
from adapter_registry.models import Tenant
from tessera.auth import AdminDep, GatewayDep
from tessera.errors import ApiError
from tessera_core.errors import TesseraError


async def run_db(gw, fn, *, changes: bool = True) -> Any:
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
    except TesseraError as e:  # the registry's, the object store's
        raise ApiError(e.http_status, str(e), param=getattr(e, "param", None)) from None
    except (ValueError, OverflowError, DataError) as e:
        # DataError: a value the database refuses (out of its column's range); not an outage.
        raise ApiError(400, str(e.orig) if isinstance(e, DataError) else str(e)) from None
    except SQLAlchemyError:
        raise ApiError(503, "the database is unavailable; try again") from None


async def get_path_tenant(_: AdminDep, gw: GatewayDep, tenant: str) -> Tenant:
    """The live tenant named by the path parameter `tenant`, else 404 ("tenant 'x' not found").

    Depends on the admin check itself, so a request without a valid admin credential is refused
    (401/403/429) before anything about tenants is revealed, whatever the route's parameter order.
    The tenant comes back detached from the session that read it: a route reads its columns
    (id, name, status, ...) freely, and `attach`es it to its own session before handing it to
    a service that writes or follows relationships."""
    return await run_db(gw, lambda session: registry.get_tenant(session=session, name=tenant), changes=False)


#: The route's `{tenant}`, resolved once (after the admin check).
PathTenant = Annotated[Tenant, Depends(get_path_tenant)]


def attach(session: Session, tenant: Tenant) -> Tenant:
    """`tenant` (from PathTenant) as an instance of `session`, without reading it again."""
    return session.merge(tenant, load=False)
