"""A version the engine finds faulty is quarantined: never resolved or fetched again, its reason
kept, adapters falling back to their newest other ready version; migration 0006 keeps data."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
from registry_helpers import write_adapter
from sqlalchemy import create_engine, text
from sqlalchemy.orm import sessionmaker

from adapter_registry import services
from adapter_registry.engine_source import RegistryAdapterSource
from adapter_registry.errors import Conflict
from adapter_registry.migrate import upgrade
from adapter_registry.settings import RegistrySettings
from engine.lora.source import AdapterFetchError

REASON = "non-finite logits in a request using this adapter"


@dataclass
class Version:
    id: int
    sha256: str


@pytest.fixture
def two_versions(ctx, tmp_path):
    with ctx.session_factory() as s:
        tenant = services.create_tenant(session=s, name="acme")
        other = services.create_tenant(session=s, name="other")
        v1 = services.upload_adapter(session=s, store=ctx.store, settings=ctx.settings, tenant=tenant, name="bot",
                                     source=write_adapter(tmp_path / "v1", seed=1))
        v2 = services.upload_adapter(session=s, store=ctx.store, settings=ctx.settings, tenant=tenant, name="bot",
                                     source=write_adapter(tmp_path / "v2", seed=2))
        # The other tenant uploads v2's very bytes: the same digest, its own version.
        theirs = services.upload_adapter(session=s, store=ctx.store, settings=ctx.settings, tenant=other,
                                         name="copy", source=tmp_path / "v2")
        assert (v1.status, v2.status, theirs.status) == ("ready", "ready", "ready") and theirs.sha256 == v2.sha256
        s.refresh(tenant), s.refresh(other)  # loaded, for use after this session
        return tenant, other, Version(v1.id, v1.sha256), Version(v2.id, v2.sha256)


def source(ctx, tmp_path) -> RegistryAdapterSource:
    return RegistryAdapterSource(session_factory=ctx.session_factory, store=ctx.store, cache_dir=tmp_path / "cache")


def test_report_fault_quarantines_every_copy_and_moves_current_back(ctx, two_versions, tmp_path):
    tenant, other, v1, v2 = two_versions
    src = source(ctx, tmp_path)
    assert src.fetch(v2.sha256).is_dir()
    src.report_fault(v2.sha256, REASON)
    with ctx.session_factory() as s:
        assert services.resolve_version(session=s, tenant=tenant, ref="bot").id == v1.id  # back to v1
        with pytest.raises(Conflict, match=f"bot@2 is quarantined: {REASON}"):
            services.resolve_version(session=s, tenant=tenant, ref="bot@2")
        with pytest.raises(Conflict, match="has no ready version"):
            services.resolve_version(session=s, tenant=other, ref="copy")
        listed = {v.version: (v.status, v.rejection_reason) for v in services.list_versions(
            session=s, tenant=tenant, name="bot")}
    assert listed == {1: ("ready", None), 2: ("quarantined", REASON)}
    with pytest.raises(AdapterFetchError, match="not found or not ready"):
        src.fetch(v2.sha256)  # even though its files are in the cache
    assert src.fetch(v1.sha256).is_dir()


def test_quarantine_is_idempotent_and_sticks_across_reuploads(ctx, two_versions, tmp_path):
    tenant, _, _, v2 = two_versions
    with ctx.session_factory() as s:
        assert services.quarantine_version(session=s, sha256=v2.sha256, reason=REASON) == 2
        assert services.quarantine_version(session=s, sha256=v2.sha256, reason="again") == 0
        again = services.upload_adapter(session=s, store=ctx.store, settings=ctx.settings, tenant=tenant, name="bot",
                                        source=tmp_path / "v2")
    assert (again.id, again.status, again.rejection_reason) == (v2.id, "quarantined", REASON)


def test_report_fault_never_raises(tmp_path):
    broken = sessionmaker(bind=create_engine(f"sqlite:///{tmp_path / 'missing' / 'x.db'}"))
    src = RegistryAdapterSource(session_factory=broken, store=None, cache_dir=tmp_path / "cache")
    src.report_fault("0" * 64, REASON)  # the database cannot even be opened: logged, not raised


def test_migration_0006_keeps_current_pointers_on_sqlite(tmp_path, adapter_dir):
    """SQLite rebuilds adapter_versions for the new CHECK constraint; the adapters' current
    pointers (ON DELETE SET NULL) survive, and 'quarantined' is then accepted."""
    url = f"sqlite:///{tmp_path / 'old.db'}"
    settings = RegistrySettings(database_url=url)
    upgrade(settings, "0005")
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO tenants (id, name, status, created_at, updated_at) VALUES (1, 'acme', 'active', "
                          "'2026-01-01', '2026-01-01')"))
        conn.execute(text("INSERT INTO adapters (id, tenant_id, name, next_version, created_at, updated_at) "
                          "VALUES (1, 1, 'bot', 2, '2026-01-01', '2026-01-01')"))
        conn.execute(text(f"INSERT INTO blobs (sha256, object_key, size_bytes, created_at) VALUES ('{'a' * 64}', 'k', 1, "
                          "'2026-01-01')"))
        conn.execute(text(f"INSERT INTO adapter_versions (id, adapter_id, version, sha256, config_sha256, weights_sha256, "
                          f"object_key, config_object_key, size_bytes, status, created_at) VALUES (1, 1, 1, '{'b' * 64}', "
                          f"'{'a' * 64}', '{'a' * 64}', 'k', 'k', 1, 'ready', '2026-01-01')"))
        conn.execute(text("UPDATE adapters SET current_version_id = 1"))
    engine.dispose()
    upgrade(settings)
    engine = create_engine(url)
    with engine.begin() as conn:
        assert conn.execute(text("SELECT current_version_id FROM adapters")).scalar() == 1
        conn.execute(text("UPDATE adapter_versions SET status = 'quarantined'"))
    engine.dispose()
