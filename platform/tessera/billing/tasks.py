"""Celery tasks of billing, and their beat schedule.

    celery -A tessera.billing.tasks worker -Q <TESSERA_BILLING_QUEUE, default billing>
    celery -A tessera.billing.tasks beat

Both read the same TESSERA_* settings as the gateway (Postgres, S3, the Redis broker). Beat
sends `rollup` every billing_rollup_interval_s and `close_due` every hour; every task is
idempotent, so a task delivered twice (acks_late after a worker died) changes nothing.
In the embedded mode no worker runs: the gateway calls the same jobs (tessera.billing.embedded).
"""
from __future__ import annotations

from functools import lru_cache

from celery import Celery
from celery.schedules import crontab

from tessera.billing import jobs
from tessera.billing.periods import Period
from tessera.settings import get_settings
from tessera_core.context import Context, build_context
from tessera_core.task_queue import base_conf

celery_app = Celery("tessera.billing")
ROLLUP_TASK = "tessera.billing.rollup"
CLOSE_DUE_TASK = "tessera.billing.close_due"
EXPORT_TASK = "tessera.billing.export"


@celery_app.on_configure.connect
def _configure(sender: Celery, **_kwargs) -> None:
    s = get_settings()
    sender.conf.update(
        **base_conf(s.celery_broker_url, s.billing_queue),
        timezone="UTC",
        beat_schedule={
            "billing-rollup": {"task": ROLLUP_TASK, "schedule": s.billing_rollup_interval_s},
            "billing-close-due": {"task": CLOSE_DUE_TASK, "schedule": crontab(minute=10)},
        },
    )


@lru_cache(maxsize=1)
def _context() -> Context:
    return build_context(get_settings())


@celery_app.task(name=ROLLUP_TASK)
def rollup_task() -> dict:
    """Roll every unbilled usage event into priced line items; returns the rollup report."""
    return jobs.rollup_job(_context()).as_dict()


@celery_app.task(name=CLOSE_DUE_TASK)
def close_due_task() -> list[int]:
    """Close every ended billing period with pending usage; returns the invoice ids."""
    return jobs.close_due_job(_context())


@celery_app.task(name=EXPORT_TASK)
def export_task(tenant_id: int, period: str, fmt: str) -> int:
    """Write the (tenant, period, format) export to the object store; returns the export's id."""
    return jobs.export_job(_context(), tenant_id=tenant_id, period=Period.parse(period), fmt=fmt).id
