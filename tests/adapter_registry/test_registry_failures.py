"""Failures mid-upload leave nothing half-made: the caller gets a clear 503-class error, no rows
remain, and objects a failed upload stored are removed by the cleanup job."""
from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import event
from sqlalchemy.exc import OperationalError

from adapter_registry import services
from adapter_registry.cleanup import collect_garbage
from adapter_registry.content import BLOB_PREFIX
from adapter_registry.errors import RegistryUnavailable
from adapter_registry.models import Adapter, AdapterVersion, Blob
from tessera_core.errors import ObjectStoreError, Unavailable


def _counts(ctx):
    with ctx.session_factory() as s:
        return s.query(Adapter).count(), s.query(AdapterVersion).count(), s.query(Blob).count()


class FailingSecondPut:
    """The real store, except that the second put fails, as a connection dropped mid-upload would."""

    def __init__(self, store):
        self.store, self.puts = store, 0

    def __getattr__(self, name):
        return getattr(self.store, name)

    def put_file(self, key, path):
        self.puts += 1
        if self.puts == 2:
            raise ObjectStoreError(f"object store unavailable: upload {key!r} failed: connection reset")
        self.store.put_file(key, path)


def test_s3_endpoint_down_gives_a_clear_503_and_stores_nothing(make_ctx, adapter_dir):
    ctx = make_ctx("postgres", create_bucket=False, s3_endpoint_url="http://127.0.0.1:9", s3_bucket="nowhere")
    with ctx.session_factory() as s:
        tenant = services.create_tenant(session=s, name="acme")
        with pytest.raises(Unavailable, match=r"object store unavailable: upload .* s3://nowhere at http://127.0.0.1:9") as e:
            services.upload_adapter(session=s, store=ctx.store, settings=ctx.settings, tenant=tenant,
                                    name="bot", source=adapter_dir)
    assert e.value.http_status == 503
    assert _counts(ctx) == (0, 0, 0)


def test_store_failing_mid_upload_leaves_no_rows_and_cleanup_removes_the_orphan(ctx, adapter_dir):
    failing = FailingSecondPut(ctx.store)
    with ctx.session_factory() as s:
        tenant = services.create_tenant(session=s, name="acme")
        with pytest.raises(Unavailable, match="connection reset"):
            services.upload_adapter(session=s, store=failing, settings=ctx.settings, tenant=tenant,
                                    name="bot", source=adapter_dir)
        assert _counts(ctx) == (0, 0, 0)
        assert len(list(ctx.store.list(BLOB_PREFIX))) == 1  # the config went up before the failure
        # Within the grace period an orphan may be an upload in flight: it is kept.
        assert collect_garbage(session=s, store=ctx.store).orphan_objects_deleted == []
        report = collect_garbage(session=s, store=ctx.store, grace=timedelta(0))
    assert len(report.orphan_objects_deleted) == 1
    assert list(ctx.store.list(BLOB_PREFIX)) == []


def test_database_failing_at_commit_leaves_no_rows_and_cleanup_removes_objects(ctx, adapter_dir):
    with ctx.session_factory() as s:
        tenant = services.create_tenant(session=s, name="acme")

    def fail_version_insert(conn, cursor, statement, *args):
        # The database going away mid-transaction, at the INSERT of the version row.
        if statement.startswith("INSERT INTO adapter_versions"):
            raise OperationalError(statement, None, ConnectionResetError("server closed the connection unexpectedly"))

    event.listen(ctx.engine, "before_cursor_execute", fail_version_insert)
    try:
        with ctx.session_factory() as s:
            with pytest.raises(RegistryUnavailable, match="database unavailable .* nothing was stored"):
                services.upload_adapter(session=s, store=ctx.store, settings=ctx.settings, tenant=tenant,
                                        name="bot", source=adapter_dir)
    finally:
        event.remove(ctx.engine, "before_cursor_execute", fail_version_insert)
    assert _counts(ctx) == (0, 0, 0)
    assert len(list(ctx.store.list(BLOB_PREFIX))) == 2
    with ctx.session_factory() as s:
        collect_garbage(session=s, store=ctx.store, grace=timedelta(0))
    assert list(ctx.store.list(BLOB_PREFIX)) == []


def test_broker_down_removes_the_version_and_says_so(make_ctx, adapter_dir):
    ctx = make_ctx("sqlite", celery_eager=False, celery_broker_url="redis://127.0.0.1:9/0")
    with ctx.session_factory() as s:
        tenant = services.create_tenant(session=s, name="acme")
        with pytest.raises(RegistryUnavailable, match="validation queue unavailable"):
            services.upload_adapter(session=s, store=ctx.store, settings=ctx.settings, tenant=tenant,
                                    name="bot", source=adapter_dir)
    assert _counts(ctx)[:2] == (0, 0)
    with ctx.session_factory() as s:
        collect_garbage(session=s, store=ctx.store, grace=timedelta(0))
    assert _counts(ctx) == (0, 0, 0) and list(ctx.store.list(BLOB_PREFIX)) == []
