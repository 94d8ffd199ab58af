"""Who gets into the admin UI and its API: sessions, CSRF, wrong passwords, tenant keys, and the
suspension of a tenant as its keys see it. Plain HTTP against the real app on loopback."""
from __future__ import annotations

import logging
import zipfile
from pathlib import Path

import httpx
import openai
import pytest

from .conftest import ADMIN_TOKEN

PIRATE = Path(__file__).resolve().parents[2] / "platform" / "tessera" / "demo_adapters" / "pirate"


def signed_in(platform) -> httpx.Client:
    """A client holding an admin session (cookies) and its CSRF token, like the browser."""
    c = httpx.Client(base_url=platform.url, timeout=60)
    r = c.post("/admin/session", json={"password": ADMIN_TOKEN})
    assert r.status_code == 204, r.text
    return c


def test_pages_send_visitors_without_a_session_to_sign_in(platform):
    with httpx.Client(base_url=platform.url, timeout=30) as c:
        for path in ("/admin", "/admin/tenants", "/admin/keys", "/admin/adapters", "/admin/usage",
                     "/admin/billing", "/admin/slo", "/admin/tenants/acme"):
            r = c.get(path)
            assert r.status_code == 303, path
            assert r.headers["location"].startswith("/admin/login"), path
        assert c.get("/admin/login").status_code == 200
        # The admin API without a session or token: 401, nothing listed.
        r = c.get("/admin/v1/tenants")
        assert r.status_code == 401
        assert "data" not in r.json()
        # A forged cookie is no session.
        c.cookies.set("tessera_admin", "forged.value.here", path="/admin")
        assert c.get("/admin/tenants").status_code == 303
        assert c.get("/admin/v1/tenants").status_code == 401


def test_a_tenant_key_reaches_neither_admin_pages_nor_admin_api(platform):
    t = platform.tenant()
    headers = {"authorization": f"Bearer {t.key}"}
    with httpx.Client(base_url=platform.url, timeout=30, headers=headers) as c:
        assert c.get("/v1/models").status_code == 200  # the key itself works on the tenant API
        assert c.get("/admin/tenants").status_code == 303
        for method, path in (("GET", "/admin/v1/tenants"), ("GET", f"/admin/v1/tenants/{t.name}/keys"),
                             ("POST", "/admin/v1/tenants"), ("PATCH", f"/admin/v1/tenants/{t.name}")):
            r = c.request(method, path, json={"name": "x"} if method != "GET" else None)
            assert r.status_code == 401, (method, path, r.text)
        # Nor can it be used as the sign-in password.
        r = c.post("/admin/session", json={"password": t.key})
        assert r.status_code == 401 and "tessera_admin" not in r.cookies


def test_session_lists_and_changes_with_csrf_token_only(platform):
    t = platform.tenant()
    c = signed_in(platform)
    csrf = c.cookies["tessera_csrf"]
    assert c.get("/admin/tenants").status_code == 200  # the app's shell
    listed = {x["name"]: x for x in c.get("/admin/v1/tenants").json()["data"]}
    assert listed[t.name]["status"] == "active" and listed[t.name]["active_keys"] == 1

    # A state-changing request on the session without the CSRF header is refused, nothing changed.
    r = c.patch(f"/admin/v1/tenants/{t.name}", json={"status": "suspended"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "csrf_failed"
    r = c.patch(f"/admin/v1/tenants/{t.name}", json={"status": "suspended"}, headers={"x-csrf-token": "wrong"})
    assert r.status_code == 403
    assert c.get(f"/admin/v1/tenants/{t.name}").json()["status"] == "active"

    r = c.post(f"/admin/v1/tenants/{t.name}/keys", json={"name": "second"}, headers={"x-csrf-token": csrf})
    assert r.status_code == 201
    keys = c.get(f"/admin/v1/tenants/{t.name}/keys").json()["data"]
    assert [k["name"] for k in keys] == ["second", "test"]
    assert all("key" not in k and "key_hash" not in k for k in keys)

    # Signing out ends it: the cookies are cleared and the pages send the browser to sign in again.
    assert c.delete("/admin/session").status_code == 204
    assert c.get("/admin/tenants").status_code == 303
    assert c.get("/admin/v1/tenants").status_code == 401


def test_wrong_password_is_refused_slowly_and_logged(platform, caplog):
    with caplog.at_level(logging.WARNING, logger="tessera.admin_session"):
        with httpx.Client(base_url=platform.url, timeout=30) as c:
            r = c.post("/admin/session", json={"password": "not-the-password"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "wrong_password"
    assert "tessera_admin" not in r.cookies
    assert r.elapsed.total_seconds() >= platform.settings.admin_login_delay_s
    assert any("admin sign-in failed" in rec.getMessage() for rec in caplog.records)


def test_suspended_tenant_keys_get_403_until_reactivated(platform):
    t = platform.tenant()
    client = platform.openai(t)
    assert client.models.list().data
    admin = platform.admin  # the Bearer admin token keeps working for the new routes
    assert admin.patch(f"/admin/v1/tenants/{t.name}", json={"status": "suspended"}).json()["status"] == "suspended"
    with pytest.raises(openai.PermissionDeniedError) as e:
        client.models.list()
    assert "suspended" in e.value.body["message"]
    admin.patch(f"/admin/v1/tenants/{t.name}", json={"status": "active"})
    assert client.models.list().data


def test_upload_route_takes_adapters_larger_than_the_json_body_limit(platform):
    """The pirate adapter (3.7 MB) is far over the test server's 64 KiB body limit, which still
    holds for every other route."""
    t = platform.tenant()
    files = [("files", (p.name, p.read_bytes())) for p in sorted(PIRATE.iterdir())]
    r = platform.admin.post(f"/admin/v1/tenants/{t.name}/adapters/pirate/versions", files=files)
    assert r.status_code == 201, r.text
    assert r.json()["status"] == "ready" and r.json()["current"]
    assert platform.admin.post("/admin/v1/tenants", content=b"x" * 70_000).status_code == 413
    got = platform.admin.get(f"/admin/v1/tenants/{t.name}/adapters").json()["data"]
    assert [(a["name"], a["current_version"]) for a in got] == [("pirate", 1)]


def test_upload_as_zip_and_incomplete_uploads_are_explained(platform, tmp_path):
    t = platform.tenant()
    archive = tmp_path / "pirate.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for p in PIRATE.iterdir():
            z.write(p, f"pirate/{p.name}")
    url = f"/admin/v1/tenants/{t.name}/adapters/zipped/versions"
    r = platform.admin.post(url, files=[("files", ("pirate.zip", archive.read_bytes(), "application/zip"))])
    assert r.status_code == 201 and r.json()["status"] == "ready", r.text

    r = platform.admin.post(url, data={"base_model": ""})
    assert r.status_code == 422 and "adapter_config.json" in r.json()["error"]["message"]
    r = platform.admin.post(url, files=[("files", ("adapter_config.json", (PIRATE / "adapter_config.json").read_bytes()))])
    assert r.status_code == 422 and "no adapter_model.safetensors" in r.json()["error"]["message"]
    got = platform.admin.get(f"/admin/v1/tenants/{t.name}/adapters/zipped").json()
    assert [v["version"] for v in got["versions"]] == [1]  # the refused uploads left nothing behind
