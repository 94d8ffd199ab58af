"""Admin web UI sessions: sign-in with the admin password, a signed session cookie, CSRF checks.

  GET    /admin/session     {"signed_in": true, "csrf": ...} or 401
  POST   /admin/session     {"password": ...} -> 204 and the two cookies; 401 after a fixed delay
  DELETE /admin/session     sign out (clears the cookies)

The password is `settings.admin_password`, or the admin token when that is unset. A wrong
password is answered only after `admin_login_delay_s` (a fixed delay, so guessing is slow and
timing says nothing) and logged with the client's address. Wrong passwords and wrong admin
tokens (the Bearer path, auth.py) count together per client address (`FailureLimiter`): after
`admin_max_failures_per_minute` of them within a minute the address gets 429 with Retry-After,
without its credential being checked, so parallel guessing gains nothing either. The counts
live in each gateway process.

Cookies (both Path=/admin, SameSite=Strict, Secure when the request came over https):
- `tessera_admin`: HttpOnly; {"sid", "csrf"} signed and timestamped with itsdangerous, valid
  for `admin_session_ttl_s`. The signing key is derived from the password, so every gateway
  replica accepts the same sessions and changing the password ends all of them. Nothing is
  stored server-side: signing out clears the cookies in the browser.
- `tessera_csrf`: the same csrf value, readable by the page's script, which sends it back in
  the `X-CSRF-Token` header on every state-changing request (double submit). A request riding
  on the session cookie without a matching header is refused with 403: another site can neither
  read the cookie nor set the header.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
import secrets
import time
from collections import OrderedDict, deque

from fastapi import APIRouter, Request, Response
from itsdangerous import BadSignature, URLSafeTimedSerializer
from pydantic import BaseModel, ConfigDict, Field

from tessera.errors import ApiError
from tessera.settings import PlatformSettings

log = logging.getLogger(__name__)

SESSION_COOKIE = "tessera_admin"
CSRF_COOKIE = "tessera_csrf"
CSRF_HEADER = "x-csrf-token"
COOKIE_PATH = "/admin"
_SAFE_METHODS = ("GET", "HEAD", "OPTIONS")

router = APIRouter(prefix="/admin")


class FailureLimiter:
    """Failed admin credentials per client address within the last `window_s` seconds. Called
    from the event loop only: a check, the comparison and `failed` run without an await between
    them, so concurrent guesses from one address cannot all pass the check before any counts."""

    def __init__(self, max_failures: int, window_s: float = 60.0, max_clients: int = 10_000):
        self.max_failures = max_failures
        self.window_s = window_s
        self.max_clients = max_clients
        self._failures: OrderedDict[str, deque] = OrderedDict()

    def retry_after(self, client: str, now: float | None = None) -> int | None:
        """Seconds until `client` may try again, or None when it may now."""
        now = time.monotonic() if now is None else now
        times = self._failures.get(client)
        if times is None or len(times) < self.max_failures or times[0] <= now - self.window_s:
            return None
        return max(1, math.ceil(times[0] + self.window_s - now))

    def failed(self, client: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        times = self._failures.pop(client, None) or deque(maxlen=self.max_failures)
        times.append(now)
        self._failures[client] = times  # most recent last
        while len(self._failures) > self.max_clients:  # bounded memory: forget the stalest
            self._failures.popitem(last=False)

    def succeeded(self, client: str) -> None:
        self._failures.pop(client, None)


def failure_limiter(request: Request, settings: PlatformSettings) -> FailureLimiter:
    """The app's limiter (one per gateway process), made on first use."""
    state = request.app.state
    limiter = getattr(state, "admin_failures", None)
    if limiter is None:
        limiter = state.admin_failures = FailureLimiter(settings.admin_max_failures_per_minute)
    return limiter


def client_address(request: Request) -> str:
    return request.client.host if request.client else "unknown"


def refuse_if_locked_out(request: Request, settings: PlatformSettings) -> None:
    """429 with Retry-After when the client's address has too many recent failures."""
    retry = failure_limiter(request, settings).retry_after(client_address(request))
    if retry is not None:
        raise ApiError(429, f"too many wrong admin credentials from your address; try again in {retry}s",
                       type="rate_limit_error", code="admin_locked_out", headers={"retry-after": str(retry)})


async def failed_attempt(request: Request, settings: PlatformSettings, what: str) -> None:
    """Count and log a wrong admin credential, then wait the fixed delay (the caller answers 401)."""
    client = client_address(request)
    failure_limiter(request, settings).failed(client)
    log.warning("admin %s failed: wrong %s from %s", "sign-in" if what == "password" else "API call", what, client)
    await asyncio.sleep(settings.admin_login_delay_s)


def admin_password(settings: PlatformSettings) -> str | None:
    """The sign-in password: admin_password, else the admin token; None disables sign-in."""
    secret = settings.admin_password or settings.admin_token
    return secret.get_secret_value() if secret is not None else None


def _serializer(settings: PlatformSettings) -> URLSafeTimedSerializer | None:
    password = admin_password(settings)
    if password is None:
        return None
    key = hmac.new(password.encode(), b"tessera admin session v1", hashlib.sha256).hexdigest()
    return URLSafeTimedSerializer(key, salt="tessera-admin-session")


def read_session(request: Request, settings: PlatformSettings) -> dict | None:
    """The request's valid, unexpired session ({"sid", "csrf"}), else None."""
    raw = request.cookies.get(SESSION_COOKIE)
    signer = _serializer(settings)
    if not raw or signer is None:
        return None
    try:
        data = signer.loads(raw, max_age=settings.admin_session_ttl_s)
    except BadSignature:  # also SignatureExpired
        return None
    return data if isinstance(data, dict) and isinstance(data.get("csrf"), str) else None


def has_session_cookie(request: Request) -> bool:
    return SESSION_COOKIE in request.cookies


def require_session(request: Request, settings: PlatformSettings) -> dict:
    """The session of an admin request authenticated by cookie: 401 without a valid one, 403 when
    a state-changing request lacks the matching CSRF header."""
    session = read_session(request, settings)
    if session is None:
        raise ApiError(401, "your admin session has expired or is invalid; sign in again at /admin/login",
                       code="admin_session_required")
    if request.method not in _SAFE_METHODS:
        given = request.headers.get(CSRF_HEADER, "")
        if not hmac.compare_digest(given.encode(), session["csrf"].encode()):
            raise ApiError(403, "the request is missing its CSRF token; reload the page and try again",
                           code="csrf_failed")
    return session


def _set_cookies(response: Response, request: Request, settings: PlatformSettings, value: str, csrf: str) -> None:
    secure = request.url.scheme == "https"
    common = dict(path=COOKIE_PATH, samesite="strict", secure=secure, max_age=settings.admin_session_ttl_s)
    response.set_cookie(SESSION_COOKIE, value, httponly=True, **common)
    response.set_cookie(CSRF_COOKIE, csrf, httponly=False, **common)


def _clear_cookies(response: Response) -> None:
    for name in (SESSION_COOKIE, CSRF_COOKIE):
        response.delete_cookie(name, path=COOKIE_PATH, samesite="strict")


class SignIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    password: str = Field(max_length=1024)


def _settings(request: Request) -> PlatformSettings:
    return request.app.state.gateway.settings


class AdminSession(BaseModel):
    """GET /admin/session: the signed-in session and the CSRF token its writes send."""

    signed_in: bool
    csrf: str


@router.get("/session", response_model=AdminSession)
async def get_session(request: Request):
    session = read_session(request, _settings(request))
    if session is None:
        raise ApiError(401, "not signed in", code="admin_session_required")
    return {"signed_in": True, "csrf": session["csrf"]}


@router.post("/session", status_code=204)
async def sign_in(body: SignIn, request: Request):
    settings = _settings(request)
    signer = _serializer(settings)
    if signer is None:
        raise ApiError(401, "admin sign-in is disabled: set TESSERA_ADMIN_TOKEN (or TESSERA_ADMIN_PASSWORD)",
                       code="admin_disabled")
    refuse_if_locked_out(request, settings)
    expected = admin_password(settings) or ""
    if not hmac.compare_digest(body.password.encode(), expected.encode()):
        await failed_attempt(request, settings, "password")
        raise ApiError(401, "wrong password", code="wrong_password")
    failure_limiter(request, settings).succeeded(client_address(request))
    csrf = secrets.token_urlsafe(32)
    value = signer.dumps({"sid": secrets.token_urlsafe(16), "csrf": csrf})
    response = Response(status_code=204)
    _set_cookies(response, request, settings, value, csrf)
    log.info("admin signed in from %s", request.client.host if request.client else "unknown")
    return response


@router.delete("/session", status_code=204)
async def sign_out(request: Request):
    # Signing out needs no CSRF token: the worst a forged request can do is sign the admin out.
    response = Response(status_code=204)
    _clear_cookies(response)
    return response
