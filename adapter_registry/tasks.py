"""Celery tasks of the registry: version validation and garbage collection.

Run a worker with `celery -A adapter_registry.tasks worker -Q <TESSERA_CELERY_QUEUE>`; it reads
the same TESSERA_* settings as the app. In embedded mode (celery_eager) uploads validate inline
and no worker is needed.

A worker has no engine and needs none: each version carries the served base model's description
it was accepted for (adapter_versions.base_description, recorded at upload by a process that
knew what the engine serves), and validation checks the files against that.

The validation task waits on a bounded child process (validation.validate_in_sandbox); its own
soft/hard time limits (the validation deadline plus room for downloading the files) catch
anything else that hangs, and a version whose task hit them is rejected with that reason, never
left validating. It retries only tessera_core's Unavailable (store, database, child start). When
a worker starts, versions left validating by a dead worker or gateway are re-queued
(services.recover_stuck_versions).
"""
from __future__ import annotations

from datetime import timedelta
from functools import lru_cache

from celery.exceptions import SoftTimeLimitExceeded
from celery.signals import worker_ready

from adapter_registry import services
from adapter_registry.cleanup import collect_garbage
from adapter_registry.settings import RegistrySettings, get_settings
from adapter_registry.task_queue import COLLECT_GARBAGE_TASK, VALIDATE_TASK, celery_app, validate_time_limits
from tessera_core.context import Context, build_context
from tessera_core.errors import Unavailable


@lru_cache(maxsize=1)
def get_context() -> Context[RegistrySettings]:
    """The worker's context, built on first use from get_settings()."""
    return build_context(get_settings())


@celery_app.task(name=VALIDATE_TASK, autoretry_for=(Unavailable,),
                 retry_backoff=True, max_retries=5)
def validate_version_task(version_id: int) -> str:
    """Validate adapter version `version_id`; returns its final status ('ready' or 'rejected')."""
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
    # Only in this app's workers, should another app's worker import this module.
    if getattr(sender, "app", None) is celery_app:
        services.recover_stuck_versions_at_start(get_context())


@celery_app.task(name=COLLECT_GARBAGE_TASK)
def collect_garbage_task(grace_seconds: float = 3600.0) -> dict:
    """Periodic cleanup of objects/blobs left by failed uploads (see cleanup.collect_garbage)."""
    ctx = get_context()
    with ctx.session_factory() as session:
        report = collect_garbage(session=session, store=ctx.store, grace=timedelta(seconds=grace_seconds))
    return {"orphan_objects_deleted": len(report.orphan_objects_deleted),
            "unused_blobs_deleted": len(report.unused_blobs_deleted)}
