"""Validation on a real Celery worker process, through the real Redis broker, against Postgres + S3.

The worker has no engine: it validates against the served model's description the version
recorded at upload (here a Qwen2-shaped base the worker's own settings know nothing of)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from registry_helpers import QWEN2, write_adapter

from adapter_registry import services

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.usefixtures("needs_redis")
def test_worker_validates_an_upload(make_ctx, tmp_path):
    queue = f"registry-test-{uuid.uuid4().hex[:8]}"  # our own queue: no other worker takes the task
    ctx = make_ctx("postgres", celery_eager=False, celery_queue=queue, celery_broker_url="redis://127.0.0.1:6379/0",
                   served_base_models=[QWEN2])
    adapter_dir = write_adapter(tmp_path / "adapter", base=QWEN2, modules=("q", "k", "v", "o"))
    s = ctx.settings
    env = {**os.environ, "TESSERA_DATABASE_URL": s.database_url, "TESSERA_OBJECT_STORE": "s3",
           "TESSERA_S3_ENDPOINT_URL": s.s3_endpoint_url, "TESSERA_S3_BUCKET": s.s3_bucket,
           "TESSERA_S3_ACCESS_KEY_ID": "testing", "TESSERA_S3_SECRET_ACCESS_KEY": "testing",
           "TESSERA_CELERY_EAGER": "false", "TESSERA_CELERY_QUEUE": queue,
           "TESSERA_CELERY_BROKER_URL": s.celery_broker_url}
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "adapter_registry.tasks", "worker", "-Q", queue, "--pool", "solo",
         "--concurrency", "1", "--without-gossip", "--without-mingle", "--without-heartbeat", "--loglevel", "WARNING"],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "worker.log", "w"))
    try:
        with ctx.session_factory() as session:
            tenant = services.create_tenant(session=session, name="acme")
            v = services.upload_adapter(session=session, store=ctx.store, settings=s, tenant=tenant,
                                        name="bot", source=adapter_dir)
            assert v.status == "validating"  # the caller sees the status while the worker runs
        deadline = time.monotonic() + 90
        status = "validating"
        while status == "validating" and time.monotonic() < deadline:
            time.sleep(0.5)
            with ctx.session_factory() as session:
                status = services.resolve_version(session=session, tenant=tenant, ref="bot@1", require_ready=False).status
        assert status == "ready", (tmp_path / "worker.log").read_text()[-2000:]
        with ctx.session_factory() as session:
            v = services.resolve_version(session=session, tenant=tenant, ref="bot")
            assert (v.version, v.base_model, v.rank) == (1, QWEN2.name, 4)
    finally:
        worker.terminate()
        worker.wait(timeout=30)
