"""One rule for the names of tenants, adapters and API keys (adapter_registry/names.py), as an
operator meets it: the admin API answers a name outside the rule 422 and a case variant of a
live name 409, each naming the field, and stores nothing; `tessera adapters upload` says so in one
line and exits 2; migration 0012 reports the names already stored that break the rule and makes
names unique ignoring case where they already are."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import quote

import pytest
from sqlalchemy import select, text
from sqlalchemy.exc import IntegrityError

from adapter_registry.migrate import upgrade
from adapter_registry.models import Tenant as TenantRow
from adapter_registry.settings import RegistrySettings
from tessera_core.db import make_engine

PIRATE = Path(__file__).resolve().parents[2] / "platform" / "tessera" / "demo_adapters" / "pirate"

BAD_IDENTIFIERS = {
    "trailing newline": "acme\n",
    "leading space": " acme",
    "trailing space": "acme ",
    "control character": "ac\x07me",
    "zero-width space": "ac\u200bme",
    "non-ASCII letter": "acmé",
    "starts with a dot": ".acme",
    "65 characters": "a" * 65,
    "empty": "",
}


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def tenant_names(platform) -> set[str]:
    r = platform.admin.get("/admin/v1/tenants")
    assert r.status_code == 200
    return {t["name"] for t in r.json()["data"]}


def create_tenant(platform, name: str):
    plan = unique("plan")
    assert platform.admin.put(f"/admin/v1/plans/{plan}", json={}).status_code == 200
    return platform.admin.post("/admin/v1/tenants", json={"name": name, "plan": plan})


@pytest.mark.parametrize("case", sorted(BAD_IDENTIFIERS))
def test_a_tenant_name_outside_the_rule_is_a_422_naming_the_field(platform, case):
    base = unique("acme")
    name = BAD_IDENTIFIERS[case].replace("acme", base) if "acme" in BAD_IDENTIFIERS[case] else BAD_IDENTIFIERS[case]
    r = create_tenant(platform, name)
    assert r.status_code == 422, (case, r.text)
    err = r.json()["error"]
    assert err["param"] == "name"
    assert "tenant name" in err["message"] and "ASCII letters, digits" in err["message"]
    assert name not in tenant_names(platform) and name.strip() not in tenant_names(platform)


def test_names_as_they_are_used_today_are_accepted(platform):
    for name in (unique("demo-tenant"), unique("t") + ".team_2", unique("Acme")):
        r = create_tenant(platform, name)
        assert r.status_code == 201, r.text
        assert r.json()["name"] == name


def test_a_tenant_differing_only_by_case_is_a_409_naming_the_field(platform):
    name = unique("acme")
    assert create_tenant(platform, name).status_code == 201
    for variant in (name.upper(), name.capitalize()):
        r = create_tenant(platform, variant)
        assert r.status_code == 409, r.text
        assert r.json()["error"]["param"] == "name"
        assert repr(name) in r.json()["error"]["message"] and "ignoring case" in r.json()["error"]["message"]
    assert create_tenant(platform, name).status_code == 409  # the same name, as before
    assert {n for n in tenant_names(platform) if n.lower() == name} == {name}
    # Lookups stay exact: the variant names no tenant.
    assert platform.admin.get(f"/admin/v1/tenants/{name.upper()}").status_code == 404


def upload(platform, tenant: str, name: str):
    files = [("files", (p.name, p.read_bytes())) for p in sorted(PIRATE.iterdir()) if p.is_file()]
    return platform.admin.post(f"/admin/v1/tenants/{tenant}/adapters/{quote(name, safe='')}/versions", files=files)


def test_adapter_names_follow_the_rule_and_are_unique_ignoring_case(platform):
    if not (PIRATE / "adapter_model.safetensors").is_file():
        pytest.skip("demo adapter 'pirate' is not there")
    t = platform.tenant()
    for name in ("pirate\n", "pirate ", "pi\x00rate", "piràte"):
        r = upload(platform, t.name, name)
        assert r.status_code == 422, (name, r.text)
        assert r.json()["error"]["param"] == "name" and "adapter name" in r.json()["error"]["message"]
    assert upload(platform, t.name, "pirate").status_code == 201
    r = upload(platform, t.name, "Pirate")
    assert r.status_code == 409 and r.json()["error"]["param"] == "name", r.text
    assert "'pirate' already exists" in r.json()["error"]["message"]
    listed = platform.admin.get(f"/admin/v1/tenants/{t.name}/adapters").json()["data"]
    assert [a["name"] for a in listed] == ["pirate"]
    # Another tenant's namespace is its own.
    assert upload(platform, platform.tenant().name, "Pirate").status_code == 201


@pytest.mark.parametrize("name,accepted", [
    ("laptop", True), ("CI key (staging)", True), ("clé de Zoë", True), ("東京", True),
    ("laptop\n", False), (" laptop", False), ("lap\ttop", False), ("cle\u0301", False),  # NFD
    ("\u202eevil", False), ("x" * 65, False), ("", False),
])
def test_api_key_names_are_printable_nfc_labels(platform, name, accepted):
    t = platform.tenant()
    r = platform.admin.post(f"/admin/v1/tenants/{t.name}/keys", json={"name": name})
    if accepted:
        assert r.status_code == 201 and r.json()["name"] == name, r.text
        return
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == "name"
    keys = platform.admin.get(f"/admin/v1/tenants/{t.name}/keys").json()["data"]
    assert name not in {k["name"] for k in keys}


def test_the_cli_refuses_a_bad_name_in_one_line(tmp_path):
    db = f"sqlite:///{tmp_path}/t.db"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")} | {
        "TESSERA_DATABASE_URL": db, "TESSERA_OBJECT_STORE_ROOT": str(tmp_path / "objects")}
    for args in (["--tenant", "acme", "--create-tenant", "pirate\n"], ["--tenant", "acme\n", "--create-tenant", "pirate"]):
        r = subprocess.run([sys.executable, "-m", "tessera.cli", "adapters", "upload", *args, str(PIRATE)], env=env,
                           cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("tessera: error: invalid "), r.stderr
        assert "name 'pirate\\n'" in lines[0] or "name (--tenant) 'acme\\n'" in lines[0]
    assert not (tmp_path / "t.db").exists()  # refused before the database was touched


ADAPTER = ("INSERT INTO adapters (tenant_id, name, next_version, created_at, updated_at) "
           "VALUES (:t, :n, 1, :now, :now)")


def test_migration_reports_names_that_break_the_rule_and_adds_case_uniqueness(tmp_path, caplog):
    settings = RegistrySettings(database_url=f"sqlite:///{tmp_path}/m.db")
    upgrade(settings, "0010")
    engine = make_engine(settings.database_url)
    now = datetime.now(timezone.utc)
    with engine.begin() as c:
        for name in ("acme", "Acme", "trailing\n", "fine"):
            c.execute(text("INSERT INTO tenants (name, status, created_at, updated_at) "
                           "VALUES (:n, 'active', :now, :now)"), {"n": name, "now": now})
        fine = c.scalar(text("SELECT id FROM tenants WHERE name = 'fine'"))
        c.execute(text(ADAPTER), {"t": fine, "n": "a\x01", "now": now})
        c.execute(text("INSERT INTO api_keys (tenant_id, prefix, key_hash, name, created_at) "
                       "VALUES (:t, 'p', 'h', :n, :now)"), {"t": fine, "n": "key\u202e", "now": now})
    with caplog.at_level(logging.WARNING):
        upgrade(settings)
    log = caplog.text
    assert "tenants id" in log and "'trailing\\n'" in log  # reported ...
    assert "adapters id" in log and "'a\\x01'" in log
    assert "api_keys id" in log and "U+202E" in log
    assert "tenants has live names equal ignoring case ('acme',)" in log
    with engine.connect() as c:  # ... and not renamed
        assert set(c.scalars(select(TenantRow.name))) == {"acme", "Acme", "trailing\n", "fine"}
    with pytest.raises(IntegrityError), engine.begin() as c:  # adapters had no collision: now unique
        c.execute(text(ADAPTER), {"t": fine, "n": "A\x01", "now": now})
    engine.dispose()
