"""Chaos with real processes: a private PostgreSQL cluster, an engine worker (`tessera
engine-worker`) and a gateway (`tessera serve`, engine over HTTP) as subprocesses, shared by the
tests of this module. The database restarts in the middle of a burst of completions; an engine
worker is killed with SIGKILL in the middle of a stream and started again. What a tenant sees:
answers or clear errors (never a hang), usage billed exactly as produced, and service back
without restarting the gateway.

The tests run in file order: the second one kills the worker the first one uses."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

import anyio
import httpx
import pytest

from adapter_registry.migrate import upgrade
from adapter_registry.settings import RegistrySettings

from .chaos_helpers import TESSERA, PrivatePostgres, Service, free_port, metric_samples, usage_events

ADMIN_TOKEN = "chaos-admin-token-" + "a" * 16
SECRET = "chaos-engine-secret-" + "s" * 16
BASE = "SmolLM2-135M-Instruct"


@dataclass
class Stack:
    pg: PrivatePostgres
    worker: Service
    worker_url: str
    gateway: Service
    url: str

    def tenant(self) -> tuple[str, str]:
        """A new tenant (no limits to speak of) and its API key, through the admin API."""
        name = "chaos-" + uuid.uuid4().hex[:8]
        with httpx.Client(base_url=self.url, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30) as admin:
            assert admin.put(f"/admin/v1/plans/{name}", json={"requests_per_minute": 10_000}).status_code == 200
            assert admin.post("/admin/v1/tenants", json={"name": name, "plan": name}).status_code == 201
            r = admin.post(f"/admin/v1/tenants/{name}/keys", json={"name": "chaos"})
        assert r.status_code == 201, r.text
        return name, r.json()["key"]

    def usage_events(self, tenant: str) -> list:
        return usage_events(self.pg.url, tenant)

    def metrics(self, name: str) -> list[tuple[dict, float]]:
        # A scale-out gateway serves /metrics on its tenant port only with the metrics token.
        return metric_samples(httpx.get(f"{self.url}/metrics", timeout=10,
                                        headers={"authorization": f"Bearer {ADMIN_TOKEN}"}).text, name)

    def start_worker(self) -> None:
        self.worker.start()
        self.worker.wait_until_answers(f"{self.worker_url}/internal/info",
                                       headers={"authorization": f"Bearer {SECRET}"})


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("chaos")
    pg = PrivatePostgres()
    services: list[Service] = []
    try:
        upgrade(RegistrySettings(database_url=pg.url))
        shared = {"database_url": pg.url, "object_store_root": root / "objects", "adapter_cache_dir": root / "cache",
                  "engine_kv_cache_mib": 64}
        worker_port = free_port()
        worker_url = f"http://127.0.0.1:{worker_port}"
        worker = Service("worker", [TESSERA, "engine-worker", "--port", str(worker_port), "--secret", SECRET],
                         cwd=root, settings=shared)
        port = free_port()
        gateway = Service("gateway", [TESSERA, "serve"], cwd=root, settings=shared | {
            "port": port, "admin_token": ADMIN_TOKEN, "celery_eager": "true",
            "engine_mode": "http", "engine_urls": json.dumps([worker_url]), "engine_secret": SECRET,
            "engine_read_timeout_s": 5, "usage_outbox_dir": root / "outbox", "usage_outbox_retry_max_s": 0.5,
            "metrics_token": ADMIN_TOKEN})
        services += [worker.start(), gateway.start()]  # both load at once
        s = Stack(pg, worker, worker_url, gateway, f"http://127.0.0.1:{port}")
        worker.wait_until_answers(f"{worker_url}/internal/info", headers={"authorization": f"Bearer {SECRET}"})
        gateway.wait_until_answers(f"{s.url}/health")
        yield s
    finally:
        for service in services:
            service.stop()
        pg.close()


def chat(max_tokens: int, content: str = "Name three colours.", **kw) -> dict:
    return {"model": BASE, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0} | kw


def test_database_restarted_mid_burst_loses_no_usage(stack):
    tenant, key = stack.tenant()
    _, unseen_key = stack.tenant()  # a key this gateway has never checked: it needs the database
    auth = {"authorization": f"Bearer {key}"}
    deferred_before = sum(v for _, v in stack.metrics("tessera_usage_events_deferred_total"))
    responses: list[httpx.Response] = []
    outage: dict = {}

    async def burst():
        async with httpx.AsyncClient(base_url=stack.url, timeout=httpx.Timeout(60)) as client:
            responses.append(await client.post("/v1/chat/completions", json=chat(8), headers=auth))  # key cached

            async def one(i: int, limiter: anyio.Semaphore):
                async with limiter:
                    responses.append(await client.post("/v1/chat/completions", json=chat(8, f"Say {i} twice."),
                                                       headers=auth))

            async def database_restart():
                while len(responses) < 5:
                    await anyio.sleep(0.02)
                await anyio.to_thread.run_sync(stack.pg.stop)
                outage["stopped_at"] = len(responses)
                outage["unseen"] = await client.post("/v1/chat/completions", json=chat(8),
                                                     headers={"authorization": f"Bearer {unseen_key}"})
                while len(responses) < 13:  # completions finish while the database is down
                    await anyio.sleep(0.02)
                await anyio.to_thread.run_sync(stack.pg.start)
                outage["started_at"] = len(responses)

            limiter = anyio.Semaphore(6)
            async with anyio.create_task_group() as tg:
                tg.start_soon(database_restart)
                for i in range(24):
                    tg.start_soon(one, i, limiter)

    anyio.run(burst)
    assert outage["started_at"] > outage["stopped_at"]
    # A request that needs the database during the outage is a clear 503, not a hang.
    assert outage["unseen"].status_code == 503, outage["unseen"].text
    assert outage["unseen"].json()["error"]["code"]
    ok = [r for r in responses if r.status_code == 200]
    for r in responses:
        assert r.status_code in (200, 503), r.text
        if r.status_code == 503:
            assert r.json()["error"]["code"]
    assert len(ok) >= 13  # at least the ones that finished before and during the outage
    deferred = sum(v for _, v in stack.metrics("tessera_usage_events_deferred_total")) - deferred_before
    assert deferred >= 1  # the outage really hit usage writes

    deadline = time.monotonic() + 60
    while any(v for _, v in stack.metrics("tessera_usage_outbox_depth")):
        assert time.monotonic() < deadline, "the outbox did not drain:\n" + stack.gateway.log_tail()
        time.sleep(0.2)
    events = stack.usage_events(tenant)
    by_id = {e.request_id: e for e in events}
    assert len(by_id) == len(events)
    for r in ok:
        assert r.json()["id"] in by_id  # every answered request is billed, once
    assert sum(e.prompt_tokens + e.completion_tokens for e in events) == \
        sum(r.json()["usage"]["total_tokens"] for r in ok)
    # Prometheus saw each request once, outage or not.
    counted = sum(v for labels, v in stack.metrics("tessera_requests_total") if labels["tenant"] == tenant)
    assert counted == len(events)


def test_engine_worker_killed_mid_stream(stack):
    tenant, key = stack.tenant()
    auth = {"authorization": f"Bearer {key}"}
    body = chat(200, "Write a long story about a lighthouse keeper and the sea.", stream=True)
    received, error, finished = 0, None, False
    with httpx.Client(base_url=stack.url, headers=auth, timeout=httpx.Timeout(60)) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            request_id = r.headers["x-request-id"]
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    finished = True
                    continue
                data = json.loads(line.removeprefix("data: "))
                if "error" in data:
                    error = data["error"]
                    continue
                if data["choices"] and data["choices"][0]["delta"].get("content"):
                    received += 1  # one engine delta per chunk, one token each
                    if received == 5:
                        stack.worker.kill()
        assert not finished and error is not None
        assert error["code"] == "engine_unavailable"

        event = next(e for e in stack.usage_events(tenant) if e.request_id == request_id)
        assert event.status == "error" and event.completion_tokens == received

        # Nothing is sent yet: with no worker up a request is a plain 503.
        r = client.post("/v1/chat/completions", json=chat(4))
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"

        stack.start_worker()  # the same port; the gateway is not restarted
        deadline = time.monotonic() + 60
        while True:
            r = client.post("/v1/chat/completions", json=chat(4))
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            assert r.status_code == 503, r.text
            time.sleep(0.5)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
