"""Celery tasks of the registry: version validation and garbage collection.

Run a worker with `celery -A adapter_registry.tasks worker -Q <TESSERA_CELERY_QUEUE>`; it reads
the same TESSERA_* settings as the app. In embedded mode (celery_eager) uploads validate inline
and no worker is needed.

The validation task waits on a bounded child process (validation.validate_in_sandbox); its own
soft/hard time limits (the validation deadline plus room for downloading the files) catch
anything else that hangs, and a version whose task hit them is rejected with that reason, never
left validating. It retries only RegistryUnavailable (store, database, child start). When a
worker starts, versions left validating by a dead worker or gateway are re-queued
(services.recover_stuck_versions).
"""
from __future__ import annotations

from datetime import timedelta

from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded
from celery.signals import worker_ready

from adapter_registry.context import get_context
from adapter_registry.errors import RegistryUnavailable
from adapter_registry.settings import RegistrySettings, get_settings

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
    sender.conf.task_annotations = {VALIDATE_TASK: validate_time_limits(s)}


def validate_time_limits(settings: RegistrySettings) -> dict:
    """Soft and hard time limits of the validation task: the child's deadline plus the slack
    services allows for downloading the files (the hard limit kills a worker process that
    ignored the soft one)."""
    from adapter_registry.services import STUCK_SLACK_S

    soft = settings.validation_timeout_s + STUCK_SLACK_S
    return {"soft_time_limit": soft, "time_limit": soft + 30}


@celery_app.task(name=VALIDATE_TASK, autoretry_for=(RegistryUnavailable,),
                 retry_backoff=True, max_retries=5)
def validate_version_task(version_id: int) -> str:
    """Validate adapter version `version_id`; returns its final status ('ready' or 'rejected')."""
    from adapter_registry import services

    ctx = get_context()
    with ctx.session_factory() as session:
        try:
            version = services.validate_version(session=session, store=ctx.store, settings=ctx.settings,
                                                version_id=version_id)
        except SoftTimeLimitExceeded:
            limit = validate_time_limits(ctx.settings)["soft_time_limit"]
            version = services.reject_validation(
                session=session, version_id=version_id,
                reason=f"validation did not finish within {limit:g} s; upload the same files again to retry")
        return version.status


@worker_ready.connect
def _recover_stuck_versions(sender=None, **_kwargs) -> None:
    # Only in this app's workers (the billing worker imports this module for base_conf).
    if getattr(sender, "app", None) is celery_app:
        from adapter_registry import services

        services.recover_stuck_versions_at_start(get_context())


@celery_app.task(name="adapter_registry.collect_garbage")
def collect_garbage_task(grace_seconds: float = 3600.0) -> dict:
    """Periodic cleanup of objects/blobs left by failed uploads (see cleanup.collect_garbage)."""
    from adapter_registry.cleanup import collect_garbage

    ctx = get_context()
    with ctx.session_factory() as session:
        report = collect_garbage(session=session, store=ctx.store, grace=timedelta(seconds=grace_seconds))
    return {"orphan_objects_deleted": len(report.orphan_objects_deleted),
            "unused_blobs_deleted": len(report.unused_blobs_deleted)}
