"""The scale-out form from the command line: `tessera engine-worker` and `tessera serve` as
separate processes, configured by TESSERA_* env vars (Postgres, Redis quotas, HTTP engine)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from adapter_registry.migrate import upgrade
from adapter_registry.settings import RegistrySettings
from tests.requirements import require_redis

from ..adapter_registry.conftest import create_pg_database, drop_pg_database
from .conftest import free_port

TESSERA = str(Path(sys.executable).parent / "tessera")


def start(args: list[str], log: Path, **kw) -> subprocess.Popen:
    """A child process whose output goes to `log` (never a pipe nobody reads)."""
    proc = subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT, **kw)
    proc.log = log
    return proc


def wait_http(url: str, proc: subprocess.Popen, headers=None, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.log.read_text()
        try:
            if httpx.get(url, headers=headers, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} never answered"
        time.sleep(0.2)


def test_serve_with_engine_worker_postgres_and_redis(tmp_path):
    require_redis()
    url = create_pg_database()
    procs = []
    try:
        upgrade(RegistrySettings(database_url=url))
        wport, gport = free_port(), free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")} | {
            "TESSERA_DATABASE_URL": url, "TESSERA_OBJECT_STORE_ROOT": str(tmp_path / "objects"),
            "TESSERA_ADAPTER_CACHE_DIR": str(tmp_path / "cache"), "TESSERA_REDIS_URL": "redis://127.0.0.1:6379/0",
            "TESSERA_REDIS_KEY_PREFIX": f"tessera-scaleout-{gport}:", "TESSERA_ENGINE_MODE": "http",
            "TESSERA_ENGINE_URLS": f'["http://127.0.0.1:{wport}"]', "TESSERA_ENGINE_SECRET": "s3cret-for-workers",
            "TESSERA_ADMIN_TOKEN": "admin-for-scaleout", "TESSERA_PORT": str(gport)}
        procs.append(start([TESSERA, "engine-worker", "--port", str(wport)], tmp_path / "worker.log",
                           cwd=tmp_path, env=env))
        wait_http(f"http://127.0.0.1:{wport}/internal/info", procs[0],
                  headers={"authorization": "Bearer s3cret-for-workers"})
        procs.append(start([TESSERA, "serve"], tmp_path / "serve.log", cwd=tmp_path, env=env))
        base = f"http://127.0.0.1:{gport}"
        wait_http(f"{base}/health", procs[1])
        admin = httpx.Client(base_url=base, headers={"authorization": "Bearer admin-for-scaleout"}, timeout=30)
        assert admin.put("/admin/v1/plans/default", json={"requests_per_minute": 100}).status_code == 200
        assert admin.post("/admin/v1/tenants", json={"name": "acme"}).status_code == 201
        key = admin.post("/admin/v1/tenants/acme/keys", json={}).json()["key"]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=8, temperature=0)
        assert "Paris" in r.choices[0].message.content
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=8, temperature=0, stream=True))
        assert text == r.choices[0].message.content
        assert admin.get("/admin/v1/tenants/acme/usage").json()["by_status"]["completed"]["requests"] == 2
    finally:
        for p in procs:
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        drop_pg_database(url)
