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
from tessera.observability import tracing
from tessera.services import Caller, TenantSuspended, authenticate, hash_key
from tessera.settings import PlatformSettings
from tessera_core.db import read_only_session

GatewayDep = Annotated[Gateway, Depends(get_gateway)]


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


async def get_caller(request: Request, gateway: GatewayDep) -> Caller:
    """The tenant behind the request's API key; 401 if missing, unknown or revoked."""
    with tracing.span("auth") as span:
        caller = await _caller(request, gateway)
        span.set_attribute("tessera.tenant", caller.tenant_name)
        return caller


async def _caller(request: Request, gateway: GatewayDep) -> Caller:
    key = _bearer(request)
    if key is None:
        raise ApiError(401, "missing API key: send the header 'Authorization: Bearer <your key>'", code="missing_api_key")

    digest = hash_key(key)
    epoch = await gateway.epoch.current()  # read before the lookup: a change after it invalidates
    cached = gateway.callers.get(digest, epoch)
    if cached is not None:
        return cached

    def lookup() -> Caller | None:
        with read_only_session(gateway.session_factory) as session:
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


async def check_admin(request: Request, settings: PlatformSettings) -> None:
    """Return when the request carries an admin credential, else raise ApiError: the configured
    admin token (Bearer), or, without an Authorization header, a signed-in admin web UI session
    (admin_session.py: state-changing requests also need its CSRF header, else 403). A wrong
    token is throttled like a wrong sign-in password: counted per client address, logged, and
    answered 401 after `admin_login_delay_s`; an address with too many recent failures gets 429
    without its token being checked. Reads headers only, never the body (app.BodyLimit calls it
    before letting an upload past the general body limit)."""
    given = _bearer(request)
    if given is None and admin_session.has_session_cookie(request):
        admin_session.require_session(request, settings)
        return
    token = settings.admin_token
    if token is None:
        raise ApiError(401, "the admin API is disabled: set TESSERA_ADMIN_TOKEN", code="admin_disabled")
    if given is None:
        raise ApiError(401, "missing admin token: send the header 'Authorization: Bearer <admin token>'",
                       code="invalid_admin_token")
    admin_session.refuse_if_locked_out(request, settings)
    if not hmac.compare_digest(given.encode(), token.get_secret_value().encode()):
        await admin_session.failed_attempt(request, settings, "admin token")
        raise ApiError(401, "invalid admin token", code="invalid_admin_token")
    admin_session.failure_limiter(request, settings).succeeded(admin_session.client_address(request))


async def require_admin(request: Request, gateway: GatewayDep) -> None:
    """The admin API's dependency: `check_admin` with the gateway's settings. A tenant's API key
    is never an admin."""
    await check_admin(request, gateway.settings)


async def admin_gate(scope) -> ApiError | None:
    """For app.BodyLimit, from the request's headers alone: None when it carries a valid admin
    credential, else the error `check_admin` answers (401, 403 or 429; throttled alike)."""
    request = Request(scope)
    try:
        await check_admin(request, request.app.state.gateway.settings)
    except ApiError as e:
        return e
    return None


AdminDep = Annotated[None, Depends(require_admin)]
