"""Celery tasks of the registry: version validation and garbage collection.

Run a worker with `celery -A adapter_registry.tasks worker -Q <TESSERA_CELERY_QUEUE>`; it reads
the same TESSERA_* settings as the app. In embedded mode (celery_eager) uploads validate inline
and no worker is needed.
"""
from __future__ import annotations

from datetime import timedelta

from celery import Celery

from adapter_registry.context import get_context
from adapter_registry.errors import RegistryUnavailable
from adapter_registry.settings import get_settings

celery_app = Celery("adapter_registry")
VALIDATE_TASK = "adapter_registry.validate_version"


def base_conf(broker_url: str, queue: str) -> dict:
    """Celery configuration every Tessera worker shares: at-least-once delivery (tasks are
    idempotent), fail fast when the broker is down, leave logging to the application."""
    return dict(
        broker_url=broker_url,
        task_default_queue=queue,
        task_acks_late=True,  # a worker that dies mid-task leaves the task for another
        task_reject_on_worker_lost=True,
        broker_connection_retry_on_startup=True,
        broker_connection_timeout=5,
        task_publish_retry=False,  # fail the caller fast (503) when the broker is down
        worker_hijack_root_logger=False,
    )


@celery_app.on_configure.connect
def _configure(sender: Celery, **_kwargs) -> None:
    # Read settings when Celery first needs its configuration, not at import time. Eagerness is
    # not set here: services run validation inline themselves when settings.celery_eager.
    s = get_settings()
    sender.conf.update(base_conf(s.celery_broker_url, s.celery_queue))


@celery_app.task(name=VALIDATE_TASK, autoretry_for=(RegistryUnavailable,),
                 retry_backoff=True, max_retries=5)
def validate_version_task(version_id: int) -> str:
    """Validate adapter version `version_id`; returns its final status ('ready' or 'rejected')."""
    from adapter_registry import services

    ctx = get_context()
    with ctx.session_factory() as session:
        version = services.validate_version(session=session, store=ctx.store, settings=ctx.settings,
                                            version_id=version_id)
        return version.status


@celery_app.task(name="adapter_registry.collect_garbage")
def collect_garbage_task(grace_seconds: float = 3600.0) -> dict:
    """Periodic cleanup of objects/blobs left by failed uploads (see cleanup.collect_garbage)."""
    from adapter_registry.cleanup import collect_garbage

    ctx = get_context()
    with ctx.session_factory() as session:
        report = collect_garbage(session=session, store=ctx.store, grace=timedelta(seconds=grace_seconds))
    return {"orphan_objects_deleted": len(report.orphan_objects_deleted),
            "unused_blobs_deleted": len(report.unused_blobs_deleted)}
