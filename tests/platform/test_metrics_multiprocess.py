"""prometheus-client multiprocess mode: `tessera serve --workers 2` in the scale-out form
(engine workers over HTTP) with /metrics on its own port (TESSERA_METRICS_PORT): requests spread
over both gateway processes, every answer of the metrics port counts all of them, and the tenant
port does not serve /metrics at all.

The engine workers are down (nothing listens at TESSERA_ENGINE_URLS), so every request is a real
503 through the gateway's engine-unavailable path, recorded as an error: the processes start in
seconds instead of loading a model (the engine worker's own /metrics is tested in test_metrics.py).
"""
from __future__ import annotations

import concurrent.futures
import os
import sys
import time
import uuid
from pathlib import Path

import httpx
from prometheus_client.multiprocess import MultiProcessCollector

from adapter_registry.migrate import upgrade
from tessera.settings import PlatformSettings

from .conftest import free_port
from .test_gateway_scaleout import start, wait_http
from .test_metrics import scrape, value

TESSERA = str(Path(sys.executable).parent / "tessera")
BASE = "SmolLM2-135M-Instruct"


def per_process(mp_dir: Path, tenant: str) -> dict[str, float]:
    """{values file: requests of `tenant` recorded by that one process}."""
    out = {}
    for f in sorted(mp_dir.glob("counter_*.db")):
        n = sum(s.value for fam in MultiProcessCollector.merge([str(f)]) for s in fam.samples
                if s.name == "tessera_requests_total" and s.labels.get("tenant") == tenant)
        if n:
            out[f.name] = n
    return out


def test_gateway_workers_share_one_view_of_the_metrics(tmp_path):
    settings = PlatformSettings(_env_file=None, database_url=f"sqlite:///{tmp_path}/t.db",
                                object_store_root=tmp_path / "objects")
    upgrade(settings)
    wport, gport, mport = free_port(), free_port(), free_port()
    mp_dir = tmp_path / "multiproc"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "PROMETHEUS_"))} | {
        "TESSERA_DATABASE_URL": settings.database_url, "TESSERA_OBJECT_STORE_ROOT": str(tmp_path / "objects"),
        "TESSERA_ADAPTER_CACHE_DIR": str(tmp_path / "cache"), "TESSERA_ENGINE_MODE": "http",
        "TESSERA_ENGINE_URLS": f'["http://127.0.0.1:{wport}"]', "TESSERA_ENGINE_SECRET": "s3cret-for-workers",
        "TESSERA_ADMIN_TOKEN": "admin-for-multiprocess",
        # Several gateway workers share quota counters and the config epoch through Redis.
        "TESSERA_REDIS_URL": "redis://127.0.0.1:6379/0",
        "TESSERA_REDIS_KEY_PREFIX": f"tessera-test:{uuid.uuid4().hex[:8]}:",
        "TESSERA_PORT": str(gport), "TESSERA_METRICS_PORT": str(mport), "PROMETHEUS_MULTIPROC_DIR": str(mp_dir)}
    procs = []
    try:
        procs.append(start([TESSERA, "serve", "--workers", "2"], tmp_path / "serve.log", cwd=tmp_path, env=env))
        base = f"http://127.0.0.1:{gport}"
        wait_http(f"{base}/health", procs[0])
        admin = httpx.Client(base_url=base, headers={"authorization": "Bearer admin-for-multiprocess"}, timeout=30)
        assert admin.put("/admin/v1/plans/default", json={}).status_code == 200
        tenant = "mp-" + uuid.uuid4().hex[:8]
        assert admin.post("/admin/v1/tenants", json={"name": tenant}).status_code == 201
        key = admin.post(f"/admin/v1/tenants/{tenant}/keys", json={}).json()["key"]

        def one(_):
            # A new connection per request: the kernel hands each to whichever worker accepts.
            with httpx.Client(timeout=120, headers={"authorization": f"Bearer {key}", "connection": "close"}) as c:
                r = c.post(f"{base}/v1/chat/completions", json={
                    "model": BASE, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0})
                assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable", r.text

        sent = 0
        # Until both gateway processes have served some: /health answers as soon as one worker is
        # up, and on a loaded machine the second can take several seconds more to start (a CI
        # run once sent 48 requests, all to the first, before the second was accepting).
        deadline = time.monotonic() + 90
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            while True:
                list(pool.map(one, range(8)))
                sent += 8
                if len(per_process(mp_dir, tenant)) >= 2 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
        by_process = per_process(mp_dir, tenant)
        assert len(by_process) >= 2, f"all requests went to one worker: {by_process}"
        assert sum(by_process.values()) == sent

        # The metrics port (served by the process supervising the workers) reports every
        # worker's requests; the tenant port does not serve /metrics, nor name the tenant.
        r = httpx.get(f"{base}/metrics", timeout=30)
        assert r.status_code == 404 and tenant not in r.text
        for _ in range(3):
            m = scrape(f"http://127.0.0.1:{mport}", headers={"connection": "close"})
            assert value(m, "tessera_requests_total", tenant=tenant, status="error") == sent
            assert value(m, "tessera_request_duration_seconds_count", tenant=tenant) == sent
            assert value(m, "tessera_request_duration_seconds_bucket", tenant=tenant, le="+Inf") == sent
            assert value(m, "tessera_request_ttft_seconds_count", tenant=tenant) == 0  # no first token
    finally:
        for p in procs:
            p.terminate()
            try:
                p.wait(timeout=30)
            except Exception:  # noqa: BLE001
                p.kill()
