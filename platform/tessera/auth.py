"""Authentication dependencies: tenants' API keys (Bearer) and the admin token.

A key is looked up by its prefix and checked by the sha256 of the whole key. Authenticated callers
are cached per gateway under the configuration epoch (epoch.py): every admin change (revoking a
key, changing quotas) bumps the epoch, so the next request on any replica reads the database
again and a revoked key is refused on the very next request.
"""
from __future__ import annotations

import hmac
from typing import Annotated

import anyio
from fastapi import Depends, Request
from sqlalchemy.exc import SQLAlchemyError

from tessera import admin_session
from tessera.errors import ApiError
from tessera.gateway import Gateway, get_gateway
from tessera.services import Caller, TenantSuspended, authenticate, hash_key

GatewayDep = Annotated[Gateway, Depends(get_gateway)]


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


async def get_caller(request: Request, gateway: GatewayDep) -> Caller:
    """The tenant behind the request's API key; 401 if missing, unknown or revoked."""
    key = _bearer(request)
    if key is None:
        raise ApiError(401, "missing API key: send the header 'Authorization: Bearer <your key>'", code="missing_api_key")

    digest = hash_key(key)
    epoch = await gateway.epoch.current()  # read before the lookup: a change after it invalidates
    cached = gateway.callers.get(digest, epoch)
    if cached is not None:
        return cached

    def lookup() -> Caller | None:
        with gateway.session_factory() as session:
            return authenticate(session=session, key=key)

    try:
        caller = await anyio.to_thread.run_sync(lookup)
    except TenantSuspended as e:
        raise ApiError(403, f"tenant {str(e)!r} is suspended; its API keys are refused until an admin reactivates it",
                       code="tenant_suspended") from None
    except SQLAlchemyError:
        raise ApiError(503, "the key database is unavailable; try again", code="service_unavailable") from None
    if caller is None:
        raise ApiError(401, "invalid or revoked API key", code="invalid_api_key")
    gateway.callers.put(digest, epoch, caller)
    return caller


CallerDep = Annotated[Caller, Depends(get_caller)]


async def require_admin(request: Request, gateway: GatewayDep) -> None:
    """401 unless the request carries the configured admin token (Bearer), or, without an
    Authorization header, a signed-in admin web UI session (admin_session.py: state-changing
    requests also need its CSRF header, else 403). A tenant's API key is never an admin."""
    if _bearer(request) is None and admin_session.has_session_cookie(request):
        admin_session.require_session(request, gateway.settings)
        return
    token = gateway.settings.admin_token
    if token is None:
        raise ApiError(401, "the admin API is disabled: set TESSERA_ADMIN_TOKEN", code="admin_disabled")
    given = _bearer(request) or ""
    if not hmac.compare_digest(given.encode(), token.get_secret_value().encode()):
        raise ApiError(401, "invalid admin token", code="invalid_admin_token")


AdminDep = Annotated[None, Depends(require_admin)]
