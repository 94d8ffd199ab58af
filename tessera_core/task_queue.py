"""The Celery configuration every Tessera worker shares (the registry's, billing's).

Each part keeps its own Celery app, task names and queue (adapter_registry.task_queue,
tessera.billing.tasks); task names are never changed, since messages may be in flight.
"""
from __future__ import annotations


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
