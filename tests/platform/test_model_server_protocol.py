"""The Gateway API Inference Extension's model-server protocol on a real `tessera engine-worker`:
its /metrics carries, under the vLLM names the extension's endpoint picker scrapes by default,
the queue length, the running requests, the KV cache's use as a fraction, and the LoRA info
series (max_lora, the running and waiting adapters by version id, the read time as its value),
and they follow what the worker is doing: a base-model request running, an adapter request
waiting behind it for the one seat, then running, then nothing."""
from __future__ import annotations

import asyncio
import os
import time
import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from adapter_registry import services as registry
from adapter_registry.migrate import upgrade
from adapter_registry.settings import RegistrySettings
from engine.config import EngineConfig
from engine.sampling_params import GenerationRequest, SamplingParams
from tessera.engine_client.http import HttpEngineClient
from tessera_core.context import build_context
from tests.adapter_registry.registry_helpers import write_adapter
from tests.engine.lora_fixtures import SMOLLM2

from .conftest import free_port
from .test_gateway_scaleout import TESSERA, start, wait_http

SECRET = "model-server-protocol-secret"
MAX_LORAS = 3
GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
          "vllm:lora_requests_info", "vllm:cache_config_info")


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """One engine worker with one seat (so later requests wait) over a SQLite registry that
    holds two ready adapter versions; yields (its URL, the versions' sha256s)."""
    root = tmp_path_factory.mktemp("msp")
    settings = RegistrySettings(database_url=f"sqlite:///{root / 'registry.db'}", object_store_root=root / "objects",
                                adapter_cache_dir=root / "upload-cache", served_base_models=[SMOLLM2])
    upgrade(settings)
    ctx = build_context(settings)
    with ctx.session_factory() as s:
        tenant = registry.create_tenant(session=s, name="acme")
        shas = []
        for name, seed in (("bot", 3), ("helper", 4)):
            version = registry.upload_adapter(session=s, store=ctx.store, settings=settings, tenant=tenant,
                                              name=name, source=write_adapter(root / name, seed=seed))
            assert version.status == "ready", version.rejection_reason
            shas.append(version.sha256)
    ctx.engine.dispose()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")} | {
        "TESSERA_ENGINE_SECRET": SECRET, "TESSERA_ENGINE_THREADS": "1", "TESSERA_ENGINE_MAX_NUM_SEQS": "1",
        "TESSERA_ENGINE_MAX_LORAS": str(MAX_LORAS), "TESSERA_DATABASE_URL": settings.database_url,
        "TESSERA_OBJECT_STORE_ROOT": str(root / "objects"), "TESSERA_ADAPTER_CACHE_DIR": str(root / "cache")}
    port = free_port()
    proc = start([TESSERA, "engine-worker", "--port", str(port)], root / "worker.log", cwd=root, env=env)
    try:
        wait_http(f"http://127.0.0.1:{port}/ready", proc)
        yield f"http://127.0.0.1:{port}", shas
    finally:
        proc.kill()
        proc.wait(timeout=30)


def scrape(url: str) -> dict:
    """The worker's /metrics, parsed as Prometheus text: family name -> family. No secret."""
    r = httpx.get(f"{url}/metrics", timeout=10)
    assert r.status_code == 200
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def value(families: dict, name: str) -> float:
    (s,) = families[name].samples
    return s.value


def lora_info(families: dict) -> dict:
    """The one vllm:lora_requests_info series: its labels, and its value under "value"."""
    (s,) = families["vllm:lora_requests_info"].samples
    return {**s.labels, "value": s.value}


async def until(url: str, pred, timeout: float = 60.0) -> dict:
    """Scrape until `pred(families)` holds; the families of that scrape."""
    deadline = time.monotonic() + timeout
    while True:
        families = await asyncio.to_thread(scrape, url)
        if pred(families):
            return families
        assert time.monotonic() < deadline, {n: families[n].samples for n in GAUGES if n in families}
        await asyncio.sleep(0.02)


def check_consistent(families: dict) -> None:
    """The protocol's series agree with Tessera's own from the same scrape."""
    for name in GAUGES:
        assert families[name].type == "gauge", name
    blocks = {s.labels["state"]: s.value for s in families["tessera_engine_kv_cache_blocks"].samples}
    assert value(families, "vllm:kv_cache_usage_perc") == pytest.approx(blocks["used"] / sum(blocks.values()))
    assert 0.0 <= value(families, "vllm:kv_cache_usage_perc") <= 1.0
    for ours, theirs in (("tessera_engine_waiting_sequences", "vllm:num_requests_waiting"),
                         ("tessera_engine_running_sequences", "vllm:num_requests_running")):
        assert sum(s.value for s in families[ours].samples) == value(families, theirs)
    (cache,) = families["vllm:cache_config_info"].samples
    assert cache.labels == {"block_size": str(EngineConfig.block_size),
                            "num_gpu_blocks": str(int(sum(blocks.values())))} and cache.value == 1


def request(max_tokens: int, adapter: str | None = None) -> GenerationRequest:
    return GenerationRequest(request_id=uuid.uuid4().hex, prompt_token_ids=[1, 504, 3458, 282, 4649, 30],
                             params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                             adapter=adapter)


def test_the_worker_reports_queue_kv_cache_and_lora_state_as_the_endpoint_picker_reads_them(worker):
    url, (bot, helper) = worker

    async def scenario():
        client = HttpEngineClient([url], secret=SECRET, poll_s=3600)
        await client.start()

        async def run(req) -> int:
            return sum([len(out.token_ids) async for out in client.generate(req)])

        try:
            t0 = time.time()
            idle = await asyncio.to_thread(scrape, url)
            check_consistent(idle)
            assert value(idle, "vllm:num_requests_waiting") == value(idle, "vllm:num_requests_running") == 0
            assert value(idle, "vllm:kv_cache_usage_perc") == 0.0
            info = lora_info(idle)
            assert info["max_lora"] == str(MAX_LORAS)
            assert info["running_lora_adapters"] == info["waiting_lora_adapters"] == ""
            assert t0 <= info["value"] <= time.time()  # the read time: the newest series is the one

            # A base-model request takes the one seat; two adapter requests then wait for it.
            base = asyncio.create_task(run(request(96)))
            running = await until(url, lambda f: value(f, "vllm:num_requests_running") == 1)
            check_consistent(running)
            assert value(running, "vllm:kv_cache_usage_perc") > 0.0
            assert lora_info(running)["running_lora_adapters"] == ""  # the base model is no adapter
            on_adapters = [asyncio.create_task(run(request(32, adapter=a))) for a in (bot, helper)]
            waiting = await until(url, lambda f: value(f, "vllm:num_requests_waiting") == 2)
            check_consistent(waiting)
            assert value(waiting, "vllm:num_requests_running") == 1
            info = lora_info(waiting)
            # A list the picker splits on "," without trimming: no spaces.
            assert info["running_lora_adapters"] == ""
            assert info["waiting_lora_adapters"] == ",".join(sorted([bot, helper]))

            # The base request ends; an adapter request runs: its adapter is running, the other's waits.
            adapter_running = await until(url, lambda f: lora_info(f)["running_lora_adapters"] != "")
            check_consistent(adapter_running)
            info = lora_info(adapter_running)
            assert {info["running_lora_adapters"], info["waiting_lora_adapters"]} == {bot, helper}
            assert value(adapter_running, "vllm:num_requests_waiting") == 1
            assert value(adapter_running, "vllm:kv_cache_usage_perc") > 0.0
            assert await base == 96 and [await t for t in on_adapters] == [32, 32]

            # Both done: nothing running or waiting, the KV blocks free (cached prefixes count as free).
            done = await until(url, lambda f: value(f, "vllm:num_requests_running") == 0)
            check_consistent(done)
            assert value(done, "vllm:num_requests_waiting") == 0 and value(done, "vllm:kv_cache_usage_perc") == 0.0
            assert lora_info(done)["running_lora_adapters"] == lora_info(done)["waiting_lora_adapters"] == ""
            assert lora_info(done)["value"] > info["value"]
        finally:
            await client.close()

    asyncio.run(scenario())
