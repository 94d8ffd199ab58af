"""Quota admission through the real server: 200 concurrent requests against a tenant allowed N,
a budget that runs out mid-burst, concurrency and token limits, and the 429 headers."""
from __future__ import annotations

import asyncio
import time
import uuid

import openai
import pytest

from tessera.quota import Limits

BASE = "SmolLM2-135M-Instruct"
MSGS = [{"role": "user", "content": "Count from one to twenty."}]


def avoid_minute_edge(margin: float = 20.0) -> None:
    """Start a burst early in a minute, so it all falls in one minute: across a boundary the
    sliding window's estimate of the previous minute lets through up to its decayed share more
    (no timing is asserted)."""
    left = 60.0 - time.time() % 60.0
    if left < margin:
        time.sleep(left + 0.1)


async def burst(client, n: int, **kw):
    async def one():
        try:
            return await client.chat.completions.with_raw_response.create(
                model=BASE, messages=MSGS, max_tokens=2, temperature=0, **kw)
        except openai.RateLimitError as e:
            return e

    return await asyncio.gather(*(one() for _ in range(n)))


def check_burst(platform, t, results, n_allowed: int):
    admitted = [r for r in results if not isinstance(r, Exception)]
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(admitted) + len(refused) == len(results)
    assert len(admitted) == n_allowed  # a fresh tenant in one minute: exactly its limit, no fewer
    for r in admitted:
        assert r.parse().usage.completion_tokens >= 1
        assert r.headers["x-ratelimit-limit-requests"] == str(n_allowed)
    for e in refused:
        h = e.response.headers
        assert e.status_code == 429 and e.body["code"] == "rate_limit_exceeded"
        assert int(h["retry-after"]) >= 1
        assert h["x-ratelimit-limit-requests"] == str(n_allowed)
        assert h["x-ratelimit-remaining-requests"] == "0"
        assert h["x-ratelimit-reset-requests"].endswith("s")
        assert h["x-ratelimit-limit-tokens"] == "1000000"
        assert int(h["x-ratelimit-remaining-tokens"]) <= 1000000
        assert h["x-ratelimit-reset-tokens"].endswith("s")
    events = platform.usage_events(t.name)
    assert len(events) == len(admitted) and {e.status for e in events} == {"completed"}


def test_200_concurrent_requests_admit_at_most_n(platform):
    n = 5
    t = platform.tenant(requests_per_minute=n, tokens_per_minute=1_000_000)
    avoid_minute_edge()
    results = asyncio.run(burst(platform.async_openai(t), 200))
    check_burst(platform, t, results, n)
    # The server keeps serving other tenants.
    other = platform.tenant()
    assert platform.openai(other).chat.completions.create(model=BASE, messages=MSGS, max_tokens=1).choices


def test_budget_runs_out_mid_burst(platform):
    probe = platform.tenant()
    prompt = platform.openai(probe).chat.completions.create(model=BASE, messages=MSGS, max_tokens=1).usage.prompt_tokens
    per_request = prompt + 4
    budget = int(2.5 * per_request)
    t = platform.tenant(monthly_token_budget=budget)
    client = platform.async_openai(t)

    async def run():
        async def one():
            try:
                return await client.chat.completions.create(model=BASE, messages=MSGS, max_tokens=4, temperature=0)
            except openai.RateLimitError as e:
                return e

        return await asyncio.gather(*(one() for _ in range(12)))

    results = asyncio.run(run())
    ok = [r for r in results if not isinstance(r, Exception)]
    refused = [r for r in results if isinstance(r, Exception)]
    assert ok and refused
    for e in refused:
        assert e.status_code == 429 and e.body["code"] == "insufficient_quota" and e.body["type"] == "insufficient_quota"
        assert int(e.response.headers["retry-after"]) >= 1
    events = platform.usage_events(t.name)
    assert len(events) == len(ok)
    assert sum(e.prompt_tokens + e.completion_tokens for e in events) <= budget
    # What is left cannot hold another request of the same size.
    left = budget - sum(e.prompt_tokens + e.completion_tokens for e in events)
    if left < per_request:
        with pytest.raises(openai.RateLimitError) as e:
            platform.openai(t).chat.completions.create(model=BASE, messages=MSGS, max_tokens=4)
        assert e.value.body["code"] == "insufficient_quota"


def test_concurrency_limit_and_release_on_disconnect(platform):
    t = platform.tenant(max_concurrent_requests=1)
    client = platform.openai(t)
    stream = client.chat.completions.create(model=BASE, messages=MSGS, max_tokens=64, temperature=0, stream=True)
    next(iter(stream))  # the request is running
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(model=BASE, messages=MSGS, max_tokens=2)
    assert "concurrent" in e.value.body["message"] and e.value.response.headers["retry-after"] == "1"
    stream.close()  # disconnect: the slot is freed once the gateway has noticed
    deadline = time.monotonic() + 30
    while True:
        try:
            client.chat.completions.create(model=BASE, messages=MSGS, max_tokens=2)
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline, "the concurrency slot was never released"
            time.sleep(0.1)


def test_tokens_per_minute_counts_prompt_plus_max_tokens(platform):
    probe = platform.tenant()
    prompt = platform.openai(probe).chat.completions.create(model=BASE, messages=MSGS, max_tokens=1).usage.prompt_tokens
    t = platform.tenant(tokens_per_minute=prompt + 10)
    client = platform.openai(t)
    avoid_minute_edge()
    with pytest.raises(openai.RateLimitError) as e:  # reserves prompt + 11 > limit
        client.chat.completions.create(model=BASE, messages=MSGS, max_tokens=11)
    assert "tokens per minute" in e.value.body["message"]
    client.chat.completions.create(model=BASE, messages=MSGS, max_tokens=2)


def test_quota_overrides_take_effect(platform):
    t = platform.tenant(requests_per_minute=1)
    r = platform.admin.patch(f"/admin/v1/tenants/{t.name}/quotas", json={"requests_per_minute": 100})
    assert r.status_code == 200 and r.json()["requests_per_minute"] == 100
    client = platform.openai(t)
    for _ in range(3):
        client.chat.completions.create(model=BASE, messages=MSGS, max_tokens=1)
    r = platform.admin.patch(f"/admin/v1/tenants/{t.name}/quotas", json={"default_priority": "realtime"})
    assert r.status_code == 400 and "realtime" in r.json()["error"]["message"]
    r = platform.admin.patch(f"/admin/v1/tenants/{t.name}/quotas",
                             json={"allowed_priorities": ["realtime", "standard"], "default_priority": "realtime"})
    assert r.status_code == 200
    client.chat.completions.create(model=BASE, messages=MSGS, max_tokens=1)
    assert {e.priority for e in platform.usage_events(t.name)} == {"standard", "realtime"}


# ---------------------------------------------------------------- the backends directly


async def _hammer(backend, tenant: str, limits: Limits, n: int, tokens: int = 10):
    return await asyncio.gather(*(backend.reserve(tenant=tenant, request_id=uuid.uuid4().hex, limits=limits,
                                                  tokens=tokens) for _ in range(n)))


def backend_semantics(make_backend):
    async def run():
        b = make_backend()
        try:
            tenant = uuid.uuid4().hex
            now = time.time()
            lim = Limits(requests_per_minute=7)
            got = await _hammer(b, tenant, lim, 200)
            assert sum(d.admitted for d in got) == 7
            refused = [d for d in got if not d.admitted]
            assert {d.reason for d in refused} == {"requests"} and all(d.remaining_requests == 0 for d in refused)

            tenant = uuid.uuid4().hex
            lim = Limits(max_concurrent_requests=3, monthly_token_budget=100)
            got = await _hammer(b, tenant, lim, 50, tokens=10)
            held = [d.reservation for d in got if d.admitted]
            assert len(held) == 3
            await b.settle(held[0], used_tokens=4)  # frees a slot and 6 budget tokens
            d = await b.reserve(tenant=tenant, request_id="x", limits=lim, tokens=10)
            assert d.admitted
            for r in held[1:] + [d.reservation]:
                await b.settle(r, used_tokens=10)
            # Budget: 4 + 30 used, 66 left -> a reservation of 67 is refused, 66 admitted.
            d = await b.reserve(tenant=tenant, request_id="y", limits=lim, tokens=67)
            assert d.reason == "budget" and d.retry_after_s >= 1
            d = await b.reserve(tenant=tenant, request_id="z", limits=lim, tokens=66)
            assert d.admitted

            tenant = uuid.uuid4().hex
            lim = Limits(tokens_per_minute=100)
            got = await _hammer(b, tenant, lim, 30, tokens=15)
            assert sum(d.admitted for d in got) == 6
            assert {d.reason for d in got if not d.admitted} == {"tokens"}
            # Two minutes later both windows have slid out: fresh counters.
            d = await b.reserve(tenant=tenant, request_id="later", limits=lim, tokens=15, now=now + 120)
            assert d.admitted

            # Sliding window: a full burst at :50 cannot be repeated right after the minute turns.
            tenant = uuid.uuid4().hex
            lim = Limits(requests_per_minute=10)
            base = int(now) // 60 * 60 + 50

            async def burst_at(t, n):
                return [await b.reserve(tenant=tenant, request_id=uuid.uuid4().hex, limits=lim, tokens=1, now=t)
                        for _ in range(n)]

            got = await burst_at(base, 11)
            assert [d.admitted for d in got] == [True] * 10 + [False]
            # Fits again when 9/10 of the previous minute's 10 remain in the window: 16 s later.
            assert got[-1].reason == "requests" and got[-1].retry_after_s == 16
            got = await burst_at(base + 16, 3)  # 6 s into the next minute: 90% of the 10 still count
            assert [d.admitted for d in got] == [True, False, False]
            got = await burst_at(base + 40, 10)  # 30 s in: 5 + 1 counted, room for 4
            assert sum(d.admitted for d in got) == 4 and got[-1].remaining_requests == 0
        finally:
            await b.close()

    asyncio.run(run())


def test_memory_backend_under_concurrency():
    from tessera.quota.memory import MemoryQuota

    backend_semantics(MemoryQuota)


def test_memory_backend_from_many_threads():
    from concurrent.futures import ThreadPoolExecutor

    from tessera.quota.memory import MemoryQuota

    b = MemoryQuota()
    lim = Limits(requests_per_minute=11, tokens_per_minute=10_000)

    def one(i):
        return asyncio.run(b.reserve(tenant="t", request_id=str(i), limits=lim, tokens=5)).admitted

    with ThreadPoolExecutor(16) as pool:
        assert sum(pool.map(one, range(300))) == 11


def test_budget_survives_a_restart_of_in_memory_counters(platform, aengine):
    """A new gateway process (fresh in-memory counters) starts the month's budget from the usage
    events, so spending before the restart still counts."""
    from tessera.app import create_app
    from tessera.engine_client.inprocess import InProcessEngineClient

    from .conftest import Platform, ServerThread

    probe = platform.tenant()
    prompt = platform.openai(probe).chat.completions.create(model=BASE, messages=MSGS, max_tokens=1).usage.prompt_tokens
    t = platform.tenant(monthly_token_budget=int(1.5 * (prompt + 4)))
    platform.openai(t).chat.completions.create(model=BASE, messages=MSGS, max_tokens=4, temperature=0)
    app = create_app(platform.settings, engine_client=InProcessEngineClient(aengine))
    with ServerThread(app) as server:
        restarted = Platform(server.url, platform.settings, app)
        with pytest.raises(openai.RateLimitError) as e:
            restarted.openai(t).chat.completions.create(model=BASE, messages=MSGS, max_tokens=4)
        assert e.value.body["code"] == "insufficient_quota"
