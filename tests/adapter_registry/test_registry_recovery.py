"""Versions a dead process left 'validating' are validated again (at start, or when their bytes are
uploaded again); a version being validated right now is left alone."""
from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from registry_calls import create_tenant, upload
from registry_helpers import write_adapter

from adapter_registry import services
from adapter_registry.models import AdapterVersion
from tessera_core.db import utcnow


@pytest.fixture
def tenant(ctx):
    return create_tenant(ctx)


def leave_validating(ctx, version_id: int, *, ago: timedelta) -> None:
    """What a validator that died mid-way leaves: status 'validating', since `ago`."""
    with ctx.session_factory() as s:
        v = s.get(AdapterVersion, version_id)
        v.status, v.rank, v.validated_at = "validating", None, None
        v.validation_started_at = utcnow() - ago
        s.commit()


def status(ctx, version_id: int) -> tuple[str, str | None]:
    with ctx.session_factory() as s:
        v = s.get(AdapterVersion, version_id)
        return v.status, v.rejection_reason


def stuck_upload(ctx, adapter_dir) -> AdapterVersion:
    """An upload validated in-process (whatever ctx's Celery settings), then left 'validating' by a
    validator that died an hour ago."""
    eager = ctx.settings.model_copy(update={"celery_eager": True})
    v = upload(ctx, create_tenant(ctx), adapter_dir, settings=eager)
    leave_validating(ctx, v.id, ago=timedelta(hours=1))
    return v


def recover(ctx) -> int:
    with ctx.session_factory() as s:
        return services.recover_stuck_versions(session=s, store=ctx.store, settings=ctx.settings)


def test_a_stuck_version_is_validated_again_at_start(ctx, tenant, tmp_path):
    good = upload(ctx, tenant, write_adapter(tmp_path / "good"))
    bad = upload(ctx, tenant, write_adapter(tmp_path / "bad", config_overrides={"lora_alpha": 1e30}))
    assert (good.status, bad.status) == ("ready", "rejected")
    leave_validating(ctx, good.id, ago=timedelta(hours=1))
    leave_validating(ctx, bad.id, ago=timedelta(hours=1))
    assert recover(ctx) == 2
    assert status(ctx, good.id) == ("ready", None)
    assert status(ctx, bad.id)[0] == "rejected" and "could overflow" in status(ctx, bad.id)[1]
    assert recover(ctx) == 0  # nothing left


def test_a_version_validating_now_is_left_alone(ctx, tenant, adapter_dir):
    v = upload(ctx, tenant, adapter_dir)
    leave_validating(ctx, v.id, ago=timedelta(seconds=1))
    assert recover(ctx) == 0
    assert status(ctx, v.id) == ("validating", None)
    # Its re-upload answers the version as it is, without starting a second validation.
    assert upload(ctx, tenant, adapter_dir).status == "validating"


def test_reuploading_the_bytes_of_a_stuck_version_validates_them(ctx, tenant, adapter_dir):
    v = upload(ctx, tenant, adapter_dir)
    leave_validating(ctx, v.id, ago=timedelta(hours=1))
    again = upload(ctx, tenant, adapter_dir)
    assert (again.id, again.status) == (v.id, "ready")
    with ctx.session_factory() as s:
        assert services.resolve_version(session=s, tenant=tenant, ref="bot").id == v.id


def test_with_celery_a_stuck_version_is_requeued_and_a_down_broker_leaves_it_for_later(make_ctx, adapter_dir):
    """Broker down: recovery logs and keeps the version (nothing raised, nothing deleted)."""
    ctx = make_ctx("sqlite", celery_eager=False, celery_broker_url="redis://127.0.0.1:9/0")
    v = stuck_upload(ctx, adapter_dir)
    assert recover(ctx) == 0
    assert status(ctx, v.id) == ("validating", None)
    assert services.recover_stuck_versions_at_start(ctx) == 0


def test_with_celery_a_stuck_version_is_sent_to_the_queue(make_ctx, adapter_dir):
    from kombu import Connection

    queue = f"registry-recover-{uuid.uuid4().hex[:8]}"
    ctx = make_ctx("sqlite", celery_eager=False, celery_queue=queue, celery_broker_url="redis://127.0.0.1:6379/0")
    v = stuck_upload(ctx, adapter_dir)
    assert recover(ctx) == 1
    with Connection(ctx.settings.celery_broker_url) as conn:
        q = conn.SimpleQueue(queue)
        try:
            msg = q.get(timeout=10)
            assert msg.headers["task"] == "adapter_registry.validate_version" and msg.headers["argsrepr"] == f"[{v.id}]"
            msg.ack()
        finally:
            q.clear()
            q.close()
    assert recover(ctx) == 0  # re-queued just now: not stuck any more
