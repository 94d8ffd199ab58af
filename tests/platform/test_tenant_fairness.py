"""One tenant's context-length prompts cannot starve another tenant's short requests, through
the public API on one in-process engine whose KV cache a single such prompt nearly fills: the
light tenant's latency stays within a bound of its idle latency, its greedy output is unchanged,
and every request of both tenants completes (engine.scheduler's fairness rule)."""
from __future__ import annotations

import statistics
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tessera.app import create_app
from tessera.engine_client.inprocess import InProcessEngineClient
from tessera.engine_client.worker import create_worker_app

from .conftest import ServerThread

BASE = "SmolLM2-135M-Instruct"
# A continuation the model is sure of, token after token (as in test_engine_resilience).
COUNTING = "1, 2, 3, 4, 5, 6, 7,"
KV_BLOCKS = 48  # 768 tokens, the context: a heavy request (below) needs all of them
STEP_TOKENS = 128
HEAVY_MAX_TOKENS = 40  # a heavy request holds the cache for this many decode steps
LIGHT_MAX_TOKENS = 16
# The bound: the light tenant's p99 under load (the largest of 8) is at most
# max(LATENCY_FACTOR x its idle latency, FLOOR_S). Each of the light request's steps also carries
# a heavy prefill chunk (up to STEP_TOKENS - 1 tokens), so its steps are longer than alone; the
# floor is for fast machines, where a few such steps are a large multiple of a short idle
# latency. Measured on a shared 2-core machine (fp32, load 3.5-6, three runs): idle 1.31,
# 1.32, 2.15 s; under load at most 2.44 s (1.86x), 3.70 s (2.79x, other tests loading the same
# cores; bound 3.97 s) and 3.39 s (1.58x). A tighter bound (e.g. 2x idle + a small constant)
# would not hold there with a margin, so this one stays.
LATENCY_FACTOR = 3.0
FLOOR_S = 3.0


@pytest.fixture(scope="module")
def small_cache_platform(platform_settings):
    """A gateway over an engine of its own with a KV cache of KV_BLOCKS blocks. Its step budget
    is small so that the step in flight when a light request arrives (a heavy prefill chunk) is
    short: the latency measured is the scheduler's doing, not the chunk size's."""
    eng = AsyncLLMEngine(LLMEngine(config=EngineConfig(weight_format="fp32", num_kv_blocks=KV_BLOCKS,
                                                       max_num_batched_tokens=STEP_TOKENS)))
    try:
        with ServerThread(create_app(platform_settings, engine_client=InProcessEngineClient(eng))) as server:
            yield server.url, eng
    finally:
        eng.shutdown()


def _client(url: str, key: str):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=300)


def _heavy_prompts(eng: AsyncLLMEngine):
    """Distinct prompts as long as the context allows with HEAVY_MAX_TOKENS more (no two share
    a cached prefix)."""
    tok, limit = eng.engine.tokenizer, eng.engine.max_model_len - HEAVY_MAX_TOKENS - 1
    body = tok.decode(tok.encode(" ".join(f"item {i}" for i in range(limit)))[:limit - 16])
    k = 0
    while True:
        prompt = f"Request {k}: {body}"
        assert len(tok.encode(prompt)) <= limit
        yield prompt
        k += 1


def _light(client) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = client.completions.create(model=BASE, prompt=COUNTING, max_tokens=LIGHT_MAX_TOKENS, temperature=0)
    return time.perf_counter() - t0, r.choices[0].text


def test_context_length_prompts_of_one_tenant_do_not_starve_another(platform, small_cache_platform):
    url, eng = small_cache_platform
    heavy_tenant, light_tenant = platform.tenant(), platform.tenant()
    heavy, light = _client(url, heavy_tenant.key), _client(url, light_tenant.key)
    prompts = _heavy_prompts(eng)
    lock = threading.Lock()

    _light(light)  # warm-up (the first request of a fresh engine pays one-off costs)
    idle = [_light(light) for _ in range(3)]
    idle_s = statistics.median(t for t, _ in idle)
    alone_text = idle[0][1]
    assert alone_text and all(text == alone_text for _, text in idle)

    stop = threading.Event()
    heavy_done: list[str] = []

    def heavy_loop() -> None:
        while not stop.is_set():
            with lock:
                prompt = next(prompts)
            r = heavy.completions.create(model=BASE, prompt=prompt, max_tokens=HEAVY_MAX_TOKENS, temperature=0)
            heavy_done.append(r.choices[0].finish_reason)

    preempted_before = eng.engine.stats["preemptions"]
    with ThreadPoolExecutor(4) as pool:
        loops = [pool.submit(heavy_loop) for _ in range(4)]
        try:
            deadline = time.monotonic() + 60
            while len(eng.engine.scheduler.waiting) + len(eng.engine.scheduler.running) < 3:
                assert time.monotonic() < deadline, "the heavy tenant's requests never queued"
                time.sleep(0.01)
            loaded = [_light(light) for _ in range(8)]
        finally:
            stop.set()
        for f in loops:
            f.result(timeout=300)  # every heavy request completed (an error would raise here)

    latencies = sorted(t for t, _ in loaded)
    bound = max(LATENCY_FACTOR * idle_s, FLOOR_S)
    print(f"\nlight tenant: idle {idle_s:.3f} s, under load p50 {statistics.median(latencies):.3f} s, "
          f"max {latencies[-1]:.3f} s (bound {bound:.2f} s); heavy requests completed: {len(heavy_done)}; "
          f"preemptions: {eng.engine.stats['preemptions'] - preempted_before}")
    assert all(text == alone_text for _, text in loaded)
    assert latencies[-1] <= bound, latencies  # 8 samples: p99 is the largest
    assert len(heavy_done) >= 4 and all(reason == "length" for reason in heavy_done), heavy_done


def test_a_plans_scheduling_weight_is_administered_and_reaches_the_engine(platform, aengine):
    """PUT /admin/v1/plans takes scheduling_weight (default 1; out of range: 422 naming it), the
    plans listing shows it, and a tenant's request runs in the engine with its plan's weight."""
    tenant = platform.tenant(scheduling_weight=2.5)
    plans = {p["name"]: p for p in platform.admin.get("/admin/v1/plans").json()["data"]}
    assert plans[tenant.name]["scheduling_weight"] == 2.5
    r = platform.admin.put(f"/admin/v1/plans/{tenant.name}", json={"requests_per_minute": 1000})
    assert r.status_code == 200 and r.json()["scheduling_weight"] == 2.5  # left out: unchanged
    for bad in (0, -1, 1e9, "heavy"):
        r = platform.admin.put(f"/admin/v1/plans/{tenant.name}", json={"scheduling_weight": bad})
        assert r.status_code == 422 and "scheduling_weight" in r.text, (bad, r.status_code, r.text)

    seen: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set() and not seen:
            seen.extend(q.tenant_weight for q in list(aengine.engine.requests.values()))
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        r = platform.openai(tenant).completions.create(model=BASE, prompt=COUNTING, max_tokens=24, temperature=0)
    finally:
        stop.set()
        watcher.join()
    assert r.choices[0].text and seen == [2.5]


def test_an_engine_worker_takes_the_weight_and_refuses_a_bad_one(aengine):
    """The worker protocol carries tenant_weight; a value the scheduler cannot take is a 400
    naming it."""
    secret = "worker-secret-" + "w" * 16
    with ServerThread(create_worker_app(aengine, secret=secret)) as worker:
        def generate(weight):
            body = {"request_id": uuid.uuid4().hex, "prompt_token_ids": [1, 2, 3], "params": {"max_tokens": 2},
                    "tenant_id": "t", "tenant_weight": weight}
            return httpx.post(f"{worker.url}/internal/generate", json=body, timeout=60,
                              headers={"authorization": f"Bearer {secret}"})
        assert generate(4).status_code == 200
        for bad in (0, -2, "2", 1e6):
            r = generate(bad)
            assert r.status_code == 400 and r.json()["param"] == "tenant_weight", (bad, r.text)
