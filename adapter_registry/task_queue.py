"""The registry's Celery app and what the gateway needs to queue work on it, without the tasks.

services.py queues validation through `send_validation`; tasks.py registers the tasks on
`celery_app` and runs them through services. Keeping the app, the task names and the validation
time limits here lets both import this module while neither imports the other. The configuration
every Tessera worker shares is tessera_core.task_queue.base_conf.
"""
from __future__ import annotations

from celery import Celery

from adapter_registry.settings import RegistrySettings, get_settings
from tessera_core.task_queue import base_conf

celery_app = Celery("adapter_registry")
VALIDATE_TASK = "adapter_registry.validate_version"
COLLECT_GARBAGE_TASK = "adapter_registry.collect_garbage"

# How long past the validation deadline a 'validating' version is left alone before it counts as
# stuck: room for downloading its files and, with Celery, for a short queue. The validation task's
# soft time limit uses the same slack, so a task still inside its limit is never counted stuck.
STUCK_SLACK_S = 60.0


def validate_time_limits(settings: RegistrySettings) -> dict:
    """Soft and hard time limits of the validation task: the child's deadline plus STUCK_SLACK_S
    for downloading the files (the hard limit kills a worker process that ignored the soft one)."""
    soft = settings.validation_timeout_s + STUCK_SLACK_S
    return {"soft_time_limit": soft, "time_limit": soft + 30}


@celery_app.on_configure.connect
def _configure(sender: Celery, **_kwargs) -> None:
    # Read settings when Celery first needs its configuration, not at import time. Eagerness is
    # not set here: services run validation inline themselves when settings.celery_eager.
    s = get_settings()
    sender.conf.update(base_conf(s.celery_broker_url, s.celery_queue))
    sender.conf.task_annotations = {VALIDATE_TASK: validate_time_limits(s)}


def send_validation(*, settings: RegistrySettings, version_id: int) -> None:
    """Queue the validation of adapter version `version_id` on the broker and queue `settings`
    name. Raises whatever the broker client raises when it refuses the task (kombu has many
    types); never retries, never runs the task eagerly."""
    # send_task, not apply_async: never run eagerly here, and use the broker these settings name
    # (the process-wide Celery config may come from other settings).
    with celery_app.connection_for_write(url=settings.celery_broker_url) as conn:
        celery_app.send_task(VALIDATE_TASK, args=[version_id], queue=settings.celery_queue,
                             connection=conn, retry=False)
