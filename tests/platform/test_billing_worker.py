"""Billing run by a real Celery worker (with its embedded beat) through the real Redis broker,
against the real Postgres and an S3-protocol store (moto's server on loopback)."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import uuid
from datetime import date, datetime, timezone
from pathlib import Path

import pytest
from sqlalchemy import func, select
from tessera.billing.exports import build_export
from tessera.billing.models import BillingRun, Export, LineItem
from tessera.billing.periods import Period

from tessera_core.objectstore import S3Store

from .billing_helpers import Ev, PriceList, add_tenant, make_context, write_events

REPO = Path(__file__).resolve().parents[2]
UTC = timezone.utc


def _wait(pred, timeout: float, log: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError("worker did not get there in time; its log ends:\n" + log.read_text()[-3000:])


@pytest.mark.slow
@pytest.mark.usefixtures("needs_redis")
def test_worker_and_beat_roll_up_and_export_to_s3(tmp_path, s3_endpoint):
    queue = f"billing-test-{uuid.uuid4().hex[:8]}"  # our own queue: no other worker takes these tasks
    bucket = f"tessera-{uuid.uuid4().hex[:10]}"
    s3 = dict(object_store="s3", s3_endpoint_url=s3_endpoint, s3_bucket=bucket, s3_access_key_id="testing",
              s3_secret_access_key="testing")
    ctx, cleanup = make_context("postgres", tmp_path, celery_eager=False, billing_queue=queue, **s3)
    assert isinstance(ctx.store, S3Store)
    ctx.store.ensure_bucket()
    log = tmp_path / "worker.log"
    worker = None
    try:
        rng = random.Random(3)
        t = add_tenant(ctx)
        prices = PriceList()
        for prio in ("standard", "batch"):
            for kind in ("input", "output"):
                prices.set(ctx, priority=prio, kind=kind, micros=rng.randrange(1, 3_000_000), eff=date(2026, 1, 1))
        events = [Ev(t.id, datetime(2026, 10, 1, tzinfo=UTC).replace(day=rng.randrange(1, 31), hour=rng.randrange(24)),
                     rng.randrange(1, 3000), rng.randrange(0, 900), priority=rng.choice(["standard", "batch"]),
                     adapter=rng.choice([None, "bot"])) for _ in range(500)]
        write_events(ctx, events)

        s = ctx.settings
        env = {**os.environ, "TESSERA_DATABASE_URL": s.database_url, "TESSERA_OBJECT_STORE": "s3",
               "TESSERA_S3_ENDPOINT_URL": s3_endpoint, "TESSERA_S3_BUCKET": bucket,
               "TESSERA_S3_ACCESS_KEY_ID": "testing", "TESSERA_S3_SECRET_ACCESS_KEY": "testing",
               "TESSERA_CELERY_EAGER": "false", "TESSERA_BILLING_QUEUE": queue,
               "TESSERA_CELERY_BROKER_URL": "redis://127.0.0.1:6379/0", "TESSERA_BILLING_ROLLUP_INTERVAL_S": "1"}
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tessera.billing.tasks", "worker", "-B", "-Q", queue,
             "--pool", "solo", "--concurrency", "1", "--without-gossip", "--without-mingle", "--without-heartbeat",
             "--schedule", str(tmp_path / "beat-schedule"), "--loglevel", "INFO"],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"))

        # Beat sends the rollup on its own; nobody here calls it.
        def billed():
            with ctx.session_factory() as ss:
                return ss.scalar(select(func.coalesce(func.sum(LineItem.requests), 0))) == len(events)

        _wait(billed, 120, log)
        with ctx.session_factory() as ss:
            total = ss.scalar(select(func.sum(LineItem.amount_picos)))
            runs = ss.scalar(select(func.count()).select_from(BillingRun))
        assert total == sum(prices.amount(e) for e in events)
        def another_run():
            with ctx.session_factory() as ss:
                return ss.scalar(select(func.count()).select_from(BillingRun)) > runs

        _wait(another_run, 30, log)
        with ctx.session_factory() as ss:  # later runs found nothing new and changed nothing
            assert ss.scalar(select(func.sum(LineItem.amount_picos))) == total

        # An export task sent through the broker writes to S3; the file is the one this process
        # would build from the same rows, byte for byte.
        from tessera.billing.tasks import celery_app

        celery_app.conf.update(broker_url="redis://127.0.0.1:6379/0", task_default_queue=queue)
        for fmt in ("csv", "parquet", "jsonl"):
            celery_app.send_task("tessera.billing.export", args=[t.id, "2026-10", fmt], queue=queue)

        def exported():
            with ctx.session_factory() as ss:
                return list(ss.scalars(select(Export).where(Export.tenant_id == t.id))) if ss.scalar(
                    select(func.count()).select_from(Export).where(Export.tenant_id == t.id)) == 3 else None

        for e in _wait(exported, 120, log):
            got = tmp_path / f"s3.{e.format}"
            ctx.store.get_file(e.object_key, got)
            with ctx.session_factory() as ss:
                mine = build_export(ss, tenant=t, period=Period.parse("2026-10"), fmt=e.format,
                                    currency="USD", out_dir=tmp_path)
            assert mine.path.read_bytes() == got.read_bytes(), e.format
            assert e.rows == (len(events) if e.format == "jsonl" else mine.rows)
    finally:
        if worker is not None:
            worker.terminate()
            worker.wait(timeout=30)
        cleanup()


def test_tasks_run_eagerly_in_the_embedded_mode(tmp_path, monkeypatch):
    """The same Celery tasks, executed in-process (Celery's eager apply), on SQLite + a local store."""
    from tessera.billing import tasks
    from tessera.settings import get_settings

    ctx, cleanup = make_context("sqlite", tmp_path)
    try:
        monkeypatch.setenv("TESSERA_DATABASE_URL", ctx.settings.database_url)
        monkeypatch.setenv("TESSERA_OBJECT_STORE_ROOT", str(ctx.settings.object_store_root))
        get_settings.cache_clear()
        tasks._context.cache_clear()
        t = add_tenant(ctx)
        prices = PriceList()
        for kind in ("input", "output"):
            prices.set(ctx, priority="standard", kind=kind, micros=250_000, eff=date(2026, 1, 1))
        events = [Ev(t.id, datetime(2026, 9, d, tzinfo=UTC), 100 * d, 10 * d) for d in range(1, 11)]
        write_events(ctx, events)
        report = tasks.rollup_task.apply().get()
        assert report["events"] == 10 and report["held"] == []
        invoices = tasks.close_due_task.apply().get()
        assert len(invoices) == 1
        export_id = tasks.export_task.apply(args=[t.id, "2026-09", "csv"]).get()
        with ctx.session_factory() as s:
            e = s.get(Export, export_id)
            assert e.final and e.rows == 10  # one line item per day
            assert s.scalar(select(func.sum(LineItem.amount_picos))) == sum(prices.amount(x) for x in events)
        assert ctx.store.head(e.object_key).size_bytes == e.size_bytes
    finally:
        get_settings.cache_clear()
        tasks._context.cache_clear()
        cleanup()


@pytest.mark.slow
@pytest.mark.usefixtures("needs_redis")
def test_admin_export_is_queued_for_a_real_worker_and_503_when_the_broker_is_down(platform_settings, aengine,
                                                                                   tmp_path):
    """The scale-out export path through the admin API, nothing faked: with celery_eager off the
    gateway answers 202 with the task id, a real worker (its own process, through the real Redis
    broker) writes the file, and the export then shows in the API's list and downloads as the
    events of the month; with the broker unreachable the same call is a 503 and nothing is queued."""
    from tessera.app import create_app
    from tessera.billing.tasks import celery_app
    from tessera.engine_client.inprocess import InProcessEngineClient

    from adapter_registry.models import Tenant
    from tessera_core.context import build_context

    from .conftest import Platform, ServerThread, free_port

    queue = f"billing-test-{uuid.uuid4().hex[:8]}"  # our own queue: no other worker takes these tasks
    settings = platform_settings.model_copy(update={"celery_eager": False, "billing_queue": queue})
    ctx = build_context(settings)
    saved = {k: celery_app.conf[k] for k in ("broker_url", "task_default_queue")}
    log = tmp_path / "worker.log"
    worker = None
    app = create_app(settings, engine_client=InProcessEngineClient(aengine))
    try:
        with ServerThread(app) as server:
            p = Platform(server.url, settings, app)
            t = p.tenant()
            with ctx.session_factory() as ss:
                tenant_id = ss.scalar(select(Tenant.id).where(Tenant.name == t.name))
            events = [Ev(tenant_id, datetime(2026, 10, d, 9, tzinfo=UTC), 10 * d, d) for d in range(1, 8)]
            write_events(ctx, events)
            url = f"/admin/v1/tenants/{t.name}/billing/periods/2026-10/exports"

            # Broker down: a clear 503, nothing written.
            celery_app.conf.update(task_default_queue=queue)
            use_broker(celery_app, f"redis://127.0.0.1:{free_port()}/0")
            r = p.admin.post(url, json={"format": "jsonl"})
            assert r.status_code == 503, r.text
            assert r.json()["error"]["message"] == "the task queue is unavailable; try again"

            # Broker up, a real worker on our queue: 202 now, the file later.
            use_broker(celery_app, "redis://127.0.0.1:6379/0")
            r = p.admin.post(url, json={"format": "jsonl"})
            assert r.status_code == 202, r.text
            queued = r.json()
            assert (queued["status"], queued["tenant"], queued["period"], queued["format"]) == (
                "queued", t.name, "2026-10", "jsonl") and queued["task_id"]
            assert p.admin.get(f"/admin/v1/tenants/{t.name}/billing/exports").json()["data"] == []

            env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")} | {
                "TESSERA_DATABASE_URL": settings.database_url,
                "TESSERA_OBJECT_STORE_ROOT": str(settings.object_store_root), "TESSERA_CELERY_EAGER": "false",
                "TESSERA_BILLING_QUEUE": queue, "TESSERA_CELERY_BROKER_URL": "redis://127.0.0.1:6379/0"}
            worker = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "tessera.billing.tasks", "worker", "-Q", queue, "--pool",
                 "solo", "--concurrency", "1", "--without-gossip", "--without-mingle", "--without-heartbeat",
                 "--loglevel", "INFO"], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"))

            def listed():
                data = p.admin.get(f"/admin/v1/tenants/{t.name}/billing/exports").json()["data"]
                return data or None

            (export,) = _wait(listed, 120, log)
            # Not final: the month has no invoice yet.
            assert (export["format"], export["rows"], export["final"]) == ("jsonl", len(events), False)
            body = p.admin.get(export["download_url"])
            assert body.status_code == 200 and body.headers["x-content-sha256"] == export["sha256"]
            lines = [json.loads(x) for x in body.text.splitlines()]
            assert sorted((x["data"]["input_tokens"], x["data"]["output_tokens"]) for x in lines) == sorted(
                (e.prompt, e.completion) for e in events)
    finally:
        if worker is not None:
            worker.terminate()
            worker.wait(timeout=30)
        celery_app.conf.update(task_default_queue=saved["task_default_queue"])
        use_broker(celery_app, saved["broker_url"])
        ctx.engine.dispose()


def use_broker(app, url: str) -> None:
    """Point this process's Celery app at `url` for its next publish. Celery keeps the
    connection pool and the producer pool made for the old URL; both are dropped."""
    app.conf.update(broker_url=url)
    app.close()
    app.amqp._producer_pool = None
