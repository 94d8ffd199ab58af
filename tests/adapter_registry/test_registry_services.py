"""Uploads, versions, the current pointer, deletion and tenant isolation, on SQLite + local
directory and on Postgres + S3 (loopback moto server)."""
from __future__ import annotations

import tarfile
import zipfile

import pytest
from registry_helpers import write_adapter

from adapter_registry import services
from adapter_registry.content import BLOB_PREFIX
from adapter_registry.errors import Conflict, NotFound, QuotaExceeded


def _upload(ctx, session, tenant, name, path, **kw):
    return services.upload_adapter(session=session, store=ctx.store, settings=ctx.settings, tenant=tenant,
                                   name=name, source=path, **kw)


def test_upload_folder_becomes_ready_and_current(ctx, session, adapter_dir):
    tenant = services.create_tenant(session=session, name="acme")
    v = _upload(ctx, session, tenant, "support-bot", adapter_dir)
    assert (v.status, v.rejection_reason) == ("ready", None)
    assert v.ref == "support-bot@1"
    assert (v.rank, v.alpha, v.target_modules, v.dtype) == (4, 8.0, ["q_proj", "v_proj"], "F16")
    assert v.base_model == "SmolLM2-135M-Instruct"  # the engine's name for the served model
    assert len(v.sha256) == 64
    assert services.resolve_version(session=session, tenant=tenant, ref="support-bot").id == v.id
    assert services.resolve_version(session=session, tenant=tenant, ref=f"support-bot@{v.sha256}").id == v.id


@pytest.mark.parametrize("fmt", ["zip", "tar.gz"])
def test_upload_archives_in_a_folder_or_at_the_root(ctx, session, adapter_dir, tmp_path, fmt):
    tenant = services.create_tenant(session=session, name="acme")
    archive = tmp_path / f"adapter.{fmt}"
    if fmt == "zip":
        with zipfile.ZipFile(archive, "w") as zf:
            for f in adapter_dir.iterdir():
                zf.write(f, f"my-adapter/{f.name}")
    else:
        with tarfile.open(archive, "w:gz") as tf:
            for f in adapter_dir.iterdir():
                tf.add(f, f.name)
    v = _upload(ctx, session, tenant, "bot", archive)
    assert v.status == "ready"
    # The same files as a folder are the same version: content addressing.
    assert _upload(ctx, session, tenant, "bot", adapter_dir).id == v.id


def test_same_bytes_are_stored_once_across_names_and_tenants(ctx, session, adapter_dir):
    a = services.create_tenant(session=session, name="a")
    b = services.create_tenant(session=session, name="b")
    va = _upload(ctx, session, a, "x", adapter_dir)
    vb = _upload(ctx, session, b, "y", adapter_dir)
    assert va.sha256 == vb.sha256 and va.id != vb.id
    assert len(list(ctx.store.list(BLOB_PREFIX))) == 2  # one config + one weights object


def test_new_versions_move_current_and_can_be_pinned(ctx, session, tmp_path):
    tenant = services.create_tenant(session=session, name="acme")
    v1 = _upload(ctx, session, tenant, "bot", write_adapter(tmp_path / "v1", seed=1))
    v2 = _upload(ctx, session, tenant, "bot", write_adapter(tmp_path / "v2", seed=2))
    assert (v1.version, v2.version) == (1, 2)
    assert services.resolve_version(session=session, tenant=tenant, ref="bot").version == 2
    services.set_current_version(session=session, tenant=tenant, ref="bot@1")
    assert services.resolve_version(session=session, tenant=tenant, ref="bot").version == 1
    assert [v.version for v in services.list_versions(session=session, tenant=tenant, name="bot")] == [1, 2]


def test_rejected_version_is_not_served_and_keeps_its_reason(ctx, session, tmp_path):
    tenant = services.create_tenant(session=session, name="acme")
    good = _upload(ctx, session, tenant, "bot", write_adapter(tmp_path / "good"))
    bad = _upload(ctx, session, tenant, "bot", write_adapter(tmp_path / "bad", tensors_hook=_poison))
    assert bad.status == "rejected" and "contains NaN or Inf" in bad.rejection_reason
    assert services.resolve_version(session=session, tenant=tenant, ref="bot").id == good.id
    with pytest.raises(Conflict, match="bot@2 is rejected: tensor .* contains NaN"):
        services.resolve_version(session=session, tenant=tenant, ref="bot@2")
    with pytest.raises(Conflict):
        services.set_current_version(session=session, tenant=tenant, ref="bot@2")
    again = services.resolve_version(session=session, tenant=tenant, ref="bot@2", require_ready=False)
    assert again.rejection_reason == bad.rejection_reason


def _poison(tensors):
    next(iter(tensors.values()))[0, 0] = float("nan")


def test_delete_version_then_adapter(ctx, session, tmp_path):
    tenant = services.create_tenant(session=session, name="acme")
    _upload(ctx, session, tenant, "bot", write_adapter(tmp_path / "v1", seed=1))
    _upload(ctx, session, tenant, "bot", write_adapter(tmp_path / "v2", seed=2))
    services.delete_adapter(session=session, tenant=tenant, ref="bot@2")
    assert services.resolve_version(session=session, tenant=tenant, ref="bot").version == 1
    with pytest.raises(NotFound):
        services.resolve_version(session=session, tenant=tenant, ref="bot@2")
    services.delete_adapter(session=session, tenant=tenant, ref="bot")
    assert services.list_adapters(session=session, tenant=tenant) == []
    with pytest.raises(NotFound, match="adapter 'bot' not found"):
        services.resolve_version(session=session, tenant=tenant, ref="bot")
    # The name is free again; the next upload starts a new adapter at version 1.
    assert _upload(ctx, session, tenant, "bot", write_adapter(tmp_path / "v3", seed=3)).version == 1


def test_adapter_count_limit_of_the_tenant(ctx, session, tmp_path):
    tenant = services.create_tenant(session=session, name="small", max_adapters=1)
    _upload(ctx, session, tenant, "one", write_adapter(tmp_path / "a", seed=1))
    with pytest.raises(QuotaExceeded, match="already has 1 adapters"):
        _upload(ctx, session, tenant, "two", write_adapter(tmp_path / "b", seed=2))
    # A new version of an existing adapter is not a new adapter.
    assert _upload(ctx, session, tenant, "one", write_adapter(tmp_path / "c", seed=3)).version == 2


class TestTenantIsolation:
    """A tenant can never list, resolve, pin, delete or overwrite another tenant's adapter."""

    @pytest.fixture
    def two(self, ctx, session, tmp_path):
        a = services.create_tenant(session=session, name="alpha")
        b = services.create_tenant(session=session, name="beta")
        va = _upload(ctx, session, a, "secret", write_adapter(tmp_path / "a", seed=1))
        return a, b, va

    def test_list(self, session, two):
        a, b, _ = two
        assert [x.name for x in services.list_adapters(session=session, tenant=a)] == ["secret"]
        assert services.list_adapters(session=session, tenant=b) == []
        with pytest.raises(NotFound):
            services.list_versions(session=session, tenant=b, name="secret")

    @pytest.mark.parametrize("ref", ["secret", "secret@1", "SHA"])
    def test_resolve(self, session, two, ref):
        a, b, va = two
        ref = f"secret@{va.sha256}" if ref == "SHA" else ref
        with pytest.raises(NotFound, match="not found"):
            services.resolve_version(session=session, tenant=b, ref=ref)

    def test_pin_and_delete(self, session, two):
        a, b, va = two
        with pytest.raises(NotFound):
            services.set_current_version(session=session, tenant=b, ref="secret@1")
        with pytest.raises(NotFound):
            services.delete_adapter(session=session, tenant=b, ref="secret")
        assert services.resolve_version(session=session, tenant=a, ref="secret").id == va.id

    def test_same_name_is_a_separate_adapter(self, ctx, session, two, tmp_path):
        a, b, va = two
        vb = _upload(ctx, session, b, "secret", write_adapter(tmp_path / "b", seed=2))
        assert vb.version == 1 and vb.adapter_id != va.adapter_id
        assert services.resolve_version(session=session, tenant=a, ref="secret").id == va.id


def test_a_version_validating_from_before_descriptions_is_checked_against_the_model_it_names(make_ctx, adapter_dir):
    """A version left validating by a release that recorded only the base's name (no description,
    under the embedded model's hub id): validated against the served model that name means."""
    from tests.engine.lora_fixtures import SMOLLM2

    ctx = make_ctx("sqlite")
    with ctx.session_factory() as session:
        tenant = services.create_tenant(session=session, name="acme")
        v = _upload(ctx, session, tenant, "bot", adapter_dir)
        v.status, v.base_model, v.base_description = "validating", "HuggingFaceTB/SmolLM2-135M-Instruct", None
        session.commit()
        again = services.validate_version(session=session, store=ctx.store, settings=ctx.settings, version_id=v.id)
        assert (again.status, again.base_model, again.base_description) == ("ready", SMOLLM2.name, SMOLLM2.to_dict())
