"""The billing jobs, as plain functions of the platform's context. Celery runs them on a worker
(tessera.billing.tasks, scheduled by beat); in the embedded mode (celery_eager) the gateway runs
the same functions on a timer in-process (tessera.billing.embedded)."""
from __future__ import annotations

import logging
from datetime import timedelta

from adapter_registry import services as registry
from tessera.billing.exports import write_export
from tessera.billing.invoices import close_due, close_period
from tessera.billing.periods import Period
from tessera.billing.rollup import RollupReport, rollup
from tessera_core.context import Context
from tessera_core.db import read_only_session

log = logging.getLogger(__name__)


def rollup_job(ctx: Context) -> RollupReport:
    report = rollup(ctx.engine)
    if report.held:
        log.warning("billing: usage held for want of a price: %s",
                    ", ".join(f"{h.base_model}/{h.priority}/{h.token_kind} ({h.tokens} tokens)" for h in report.held))
    return report


def close_due_job(ctx: Context) -> list[int]:
    """Roll up, then close every ended month; returns the invoice ids (old and new)."""
    settings = ctx.settings
    rollup_job(ctx)
    invoices = close_due(ctx.engine, currency=settings.billing_currency,
                         grace=timedelta(seconds=settings.billing_close_grace_s))
    return [i.id for i in invoices]


def close_period_job(ctx: Context, *, tenant_id: int, period: Period):
    """Roll up, then close one tenant's period (PeriodNotEnded if it has not ended)."""
    rollup_job(ctx)
    return close_period(ctx.engine, tenant_id=tenant_id, period=period, currency=ctx.settings.billing_currency,
                        grace=timedelta(seconds=ctx.settings.billing_close_grace_s))


def export_job(ctx: Context, *, tenant_id: int, period: Period, fmt: str):
    """Roll up (so an open period's export is current), then write the export; returns its record."""
    rollup_job(ctx)
    with read_only_session(ctx.session_factory) as session:  # write_export writes in its own transaction
        tenant = registry.get_tenant(session=session, tenant_id=tenant_id)
        return write_export(session, ctx.store, tenant=tenant, period=period, fmt=fmt,
                            currency=ctx.settings.billing_currency)
