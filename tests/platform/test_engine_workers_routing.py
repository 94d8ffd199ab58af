"""Two real `tessera engine-worker` processes behind the HTTP engine client: both publish their
state and serve; SIGTERM drains one (its /ready says draining, new requests go to the other, the
request in flight runs to its end, then it exits); SIGKILL of the last one ends its in-flight
stream with EngineUnavailable (the gateway's 503) and leaves the client not ready. A worker that
died since the last poll costs a request nothing: it is retried on another."""
from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import pytest

from engine.sampling_params import GenerationRequest, Priority, SamplingParams
from tessera.engine_client import EngineUnavailable
from tessera.engine_client.http import HttpEngineClient
from tessera.engine_client.routing import ReplicaState

from .conftest import free_port
from .test_gateway_scaleout import TESSERA, start, wait_http

SECRET = "workers-routing-secret"
AUTH = {"authorization": f"Bearer {SECRET}"}


@pytest.fixture
def two_workers(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")} | {
        "TESSERA_ENGINE_SECRET": SECRET, "TESSERA_ENGINE_THREADS": "1", "TESSERA_ENGINE_DRAIN_TIMEOUT_S": "60",
        "TESSERA_DATABASE_URL": f"sqlite:///{tmp_path}/registry.db",
        "TESSERA_OBJECT_STORE_ROOT": str(tmp_path / "objects"), "TESSERA_ADAPTER_CACHE_DIR": str(tmp_path / "cache")}
    ports = [free_port(), free_port()]
    procs = [start([TESSERA, "engine-worker", "--port", str(p)], tmp_path / f"worker{i}.log", cwd=tmp_path, env=env)
             for i, p in enumerate(ports)]
    try:
        for p, proc in zip(ports, procs):
            wait_http(f"http://127.0.0.1:{p}/internal/info", proc, headers=AUTH)
        yield [f"http://127.0.0.1:{p}" for p in ports], procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


def request(max_tokens: int, priority=Priority.standard) -> GenerationRequest:
    return GenerationRequest(request_id=uuid.uuid4().hex, prompt_token_ids=[1, 504, 3458, 282, 4649, 30],
                             params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                             priority=priority)


async def collect(client, req) -> int:
    n = 0
    async for out in client.generate(req):
        n += len(out.token_ids)
    return n


async def wait_running(client: HttpEngineClient, urls: list[str], timeout=60.0) -> int:
    """The index of the first worker in `urls` seen publishing a running sequence."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for i, url in enumerate(urls):
            r = await client.client.get(f"{url}/internal/state", headers=AUTH)
            if sum(r.json()["running"].values()):
                return i
        await asyncio.sleep(0.05)
    raise AssertionError("no worker ever ran the request")


def test_sigterm_drains_a_worker_and_sigkill_of_the_last_is_a_503(two_workers):
    urls, procs = two_workers

    async def scenario():
        # A third URL where nothing listens, as worker-0; polls only when the test asks.
        client = HttpEngineClient([f"http://127.0.0.1:{free_port()}"] + urls, secret=SECRET, poll_s=3600)
        await client.start()
        try:
            assert (await client.ready()).engines == {"worker-0": "unreachable", "worker-1": "ready",
                                                      "worker-2": "ready"}
            state = (await client.client.get(f"{urls[0]}/internal/state", headers=AUTH)).json()
            assert state["free_kv_blocks"] == state["total_kv_blocks"] > 0 and state["draining"] is False
            assert (await client.client.get(f"{urls[0]}/internal/state")).status_code == 401

            # worker-0 as its last poll saw it before it died: idle, the most free KV, so routed
            # to first. Nothing was streamed from it, so the request is served by another worker.
            client.replicas[0].published = ReplicaState(name="worker-0", free_kv_blocks=10**6)
            assert client._order(request(1))[0] is client.replicas[0]
            assert await collect(client, request(4)) == 4
            assert client.replicas[0].published.state == "unreachable"  # out at once, before any poll

            # A long request, then SIGTERM to the worker running it: that worker drains.
            long = asyncio.create_task(collect(client, request(160)))
            busy = await wait_running(client, urls)
            other = 1 - busy
            busy_r, other_r = client.replicas[busy + 1], client.replicas[other + 1]
            procs[busy].send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while (r := await client.client.get(f"{urls[busy]}/ready")).status_code != 503:
                assert time.monotonic() < deadline, "the worker never said it drains"
                await asyncio.sleep(0.05)
            assert r.json()["status"] == "draining"
            refused = await client.client.post(f"{urls[busy]}/internal/generate", headers=AUTH, json={
                "request_id": "x", "prompt_token_ids": [1, 2], "params": {"max_tokens": 1}})
            assert refused.status_code == 503
            await client.refresh()
            assert busy_r.published.state == "draining"
            # New requests go to the other worker, and are served there.
            assert await collect(client, request(4)) == 4
            assert procs[busy].poll() is None  # still finishing its request
            # The drained request ran to its end; then the worker exited.
            assert await long == 160
            procs[busy].wait(timeout=30)
            await client.refresh()
            assert busy_r.published.state == "unreachable"
            assert (await client.ready()).ready
            assert "SIGTERM: draining 1 request(s)" in procs[busy].log.read_text()

            # SIGKILL of the last worker mid-stream: the stream ends with EngineUnavailable.
            got = []

            async def stream():
                async for out in client.generate(request(200)):
                    got.append(out)

            task = asyncio.create_task(stream())
            while not got:
                await asyncio.sleep(0.02)
            procs[other].kill()
            with pytest.raises(EngineUnavailable):
                await task
            assert not other_r.published.accepting  # out at once, before any poll
            with pytest.raises(EngineUnavailable):
                await collect(client, request(2))
            assert not (await client.ready()).ready
        finally:
            await client.close()

    asyncio.run(scenario())
