"""Serves the admin web UI (admin_ui/ at the repository root) under /admin.

  GET /admin/login                 the sign-in page (public)
  GET /admin, /admin/{page}        the single-page app's shell, for a signed-in admin; anyone else
  GET /admin/tenants/{name}        is sent to /admin/login?next=... (303)
  /admin/static/...                the app's own scripts and styles (admin_ui/static, public)
  /admin/vendor/...                libraries copied from npm by the build (admin_ui/dist/vendor)

The pages hold no data: every action of the app goes through the JSON admin API (/admin/v1) with
the session cookie and its CSRF header (admin_session.py), the same API a script calls with the
admin token. A tenant's API key opens nothing here: pages look at the session cookie only.
"""
from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

from tessera import admin_session
from tessera.errors import ApiError

UI_DIR = Path(__file__).resolve().parents[2] / "admin_ui"
PAGES = ("tenants", "keys", "adapters", "usage", "billing", "slo")
# Scripts and styles come from this origin only; Chart.js sets canvas sizes through style attributes.
_HEADERS = {
    "Content-Security-Policy": ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                                "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; "
                                "base-uri 'none'; form-action 'self'"),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

router = APIRouter(prefix="/admin", include_in_schema=False)


def _page(name: str) -> FileResponse:
    path = UI_DIR / name
    if not path.is_file():
        raise ApiError(503, f"the admin UI files are missing ({path}); run `make setup`", code="admin_ui_missing")
    return FileResponse(path, media_type="text/html", headers=_HEADERS)


def _shell(request: Request):
    if admin_session.read_session(request, request.app.state.gateway.settings) is None:
        back = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return RedirectResponse(f"/admin/login?next={quote(back, safe='/')}", status_code=303)
    return _page("index.html")


@router.get("/login")
async def login_page(request: Request):
    if admin_session.read_session(request, request.app.state.gateway.settings) is not None:
        return RedirectResponse("/admin/tenants", status_code=303)
    return _page("login.html")


@router.get("")
@router.get("/")
async def home(request: Request):
    response = _shell(request)
    return RedirectResponse("/admin/tenants", status_code=303) if isinstance(response, FileResponse) else response


@router.get("/{page}")
async def page(page: str, request: Request):
    if page not in PAGES:
        raise ApiError(404, f"no admin page {page!r}", code="unknown_url")
    return _shell(request)


@router.get("/tenants/{name}")
async def tenant_page(name: str, request: Request):
    return _shell(request)


def mount(app: FastAPI) -> None:
    """Add the session routes, the pages and the static files to `app`."""
    app.include_router(admin_session.router)
    app.include_router(router)
    app.mount("/admin/static", StaticFiles(directory=UI_DIR / "static", check_dir=False), name="admin-static")
    app.mount("/admin/vendor", StaticFiles(directory=UI_DIR / "dist" / "vendor", check_dir=False), name="admin-vendor")
