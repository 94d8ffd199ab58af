"""The embedded stand-in for Celery beat: with celery_eager, the gateway process runs the billing
rollup every billing_rollup_interval_s and closes ended periods once an hour, on a worker thread
(the same jobs a Celery worker runs in scale-out)."""
from __future__ import annotations

import logging
import time

import anyio

from tessera.billing import jobs
from tessera_core.context import Context

log = logging.getLogger(__name__)
CLOSE_EVERY_S = 3600.0


async def billing_loop(ctx: Context) -> None:
    """Run until cancelled. A failing run is logged and retried at the next tick."""
    interval = ctx.settings.billing_rollup_interval_s
    last_close = 0.0
    while True:
        await anyio.sleep(interval)
        try:
            if time.monotonic() - last_close >= CLOSE_EVERY_S:
                await anyio.to_thread.run_sync(jobs.close_due_job, ctx)
                last_close = time.monotonic()
            else:
                await anyio.to_thread.run_sync(jobs.rollup_job, ctx)
        except Exception:  # noqa: BLE001 - billing must never take the gateway down
            log.exception("billing: embedded run failed; retrying in %.0f s", interval)
