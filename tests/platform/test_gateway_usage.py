"""Usage metering: one durable event per request, aborted streams billed for what was forwarded,
the engine freeing an abandoned request, and usage summing to what the engine produced."""
from __future__ import annotations

import asyncio
import json
import time

import httpx

from tessera.app import create_app
from tessera.engine_client import EngineUnavailable
from tessera.engine_client.inprocess import InProcessEngineClient
from tessera.metering import Usage

from .conftest import Platform, ServerThread, wait_engine_idle

BASE = "SmolLM2-135M-Instruct"
LONG = [{"role": "user", "content": "Write a long story about a dragon who learns to bake bread."}]


class CountingEngineClient:
    """The real in-process client, counting every token the engine handed to the gateway."""

    def __init__(self, inner):
        self.inner = inner
        self.tokenizer, self.model_name, self.max_model_len = inner.tokenizer, inner.model_name, inner.max_model_len
        self.base_model = inner.base_model
        self.completion_tokens = 0
        self.prompt_tokens = 0

    async def generate(self, request):
        first = True
        async for out in self.inner.generate(request):
            self.completion_tokens += len(out.token_ids)
            if first:  # the engine accepted the prompt and computed it
                self.prompt_tokens += out.prompt_tokens
                first = False
            yield out

    async def start(self):
        await self.inner.start()

    async def close(self):
        await self.inner.close()


class DyingEngineClient(CountingEngineClient):
    """The real in-process client whose engine goes away (as a killed worker's HTTP client
    reports it) after handing the gateway `deltas` deltas of a request."""

    def __init__(self, inner, deltas: int):
        super().__init__(inner)
        self.deltas = deltas

    async def generate(self, request):
        n = 0
        async for out in super().generate(request):
            yield out
            n += 1
            if n == self.deltas:
                raise EngineUnavailable("the engine worker went away")


def free_blocks(aengine) -> int:
    return aengine.engine.block_manager.num_free_blocks


def wait_events(platform, tenant, n, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        events = platform.usage_events(tenant)
        if len(events) >= n or time.monotonic() > deadline:
            return events
        time.sleep(0.05)


def stream_and_disconnect(url, key, chunks: int, max_tokens: int = 64) -> tuple[int, str]:
    """Open a chat stream, read `chunks` content chunks, drop the connection; (chunks read, id)."""
    body = {"model": BASE, "messages": LONG, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    got, rid = 0, None
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", f"{url}/v1/chat/completions", json=body,
                      headers={"authorization": f"Bearer {key}"}) as r:
            assert r.status_code == 200
            rid = r.headers["x-request-id"]
            for line in r.iter_lines():
                if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                    got += 1
                    if got == chunks:
                        break
    return got, rid


def test_client_disconnect_aborts_in_engine_and_bills_what_was_sent(platform, aengine):
    wait_engine_idle(aengine)
    total = free_blocks(aengine)
    t = platform.tenant()
    got, rid = stream_and_disconnect(platform.url, t.key, chunks=3, max_tokens=200)
    wait_engine_idle(aengine)
    assert free_blocks(aengine) == total  # the sequence's KV blocks are back
    [event] = wait_events(platform, t.name, 1)
    assert event.request_id == rid and event.status == "aborted"
    # Billed for the tokens forwarded: at least what we read, far less than max_tokens.
    assert got <= event.completion_tokens < 200
    assert event.prompt_tokens > 0 and event.ttft_ms is not None and event.duration_ms >= event.ttft_ms


def test_non_streaming_client_that_leaves_aborts_the_generation(platform, aengine):
    # Starlette does not cancel a plain endpoint when its client goes away; the gateway must, or a
    # long answer nobody reads runs to the end and is billed as completed.
    wait_engine_idle(aengine)
    total = free_blocks(aengine)
    t = platform.tenant()
    body = {"model": BASE, "messages": LONG, "max_tokens": 400, "temperature": 0}
    with httpx.Client(timeout=httpx.Timeout(60, read=0.5)) as c:
        try:
            c.post(f"{platform.url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {t.key}"})
            raise AssertionError("the answer came back within 0.5 s; the test needs a longer generation")
        except httpx.ReadTimeout:
            pass  # leaving the with-block closes the connection
    [event] = wait_events(platform, t.name, 1)
    wait_engine_idle(aengine)
    assert free_blocks(aengine) == total
    assert event.status == "aborted" and event.completion_tokens == 0 and event.prompt_tokens > 0


def test_usage_sums_to_what_the_engine_produced(platform, aengine):
    counting = CountingEngineClient(InProcessEngineClient(aengine))
    app = create_app(platform.settings, engine_client=counting)
    with ServerThread(app) as server:
        p = Platform(server.url, platform.settings, app)
        t = p.tenant()
        client = p.async_openai(t)

        async def complete(i):
            msgs = [{"role": "user", "content": f"Say a word about the number {i}."}]
            if i % 2:
                r = await client.chat.completions.create(model=BASE, messages=msgs, max_tokens=6, temperature=0)
                return r.usage.completion_tokens
            n = 0
            async for c in await client.chat.completions.create(model=BASE, messages=msgs, max_tokens=6,
                                                                temperature=0, stream=True):
                n += bool(c.choices and c.choices[0].delta.content)
            return n

        async def run():
            done = asyncio.gather(*(complete(i) for i in range(4)))
            aborted = asyncio.gather(*(asyncio.to_thread(stream_and_disconnect, p.url, t.key, k, 64)
                                       for k in (1, 2, 3)))
            return await done, await aborted

        done, aborted = asyncio.run(run())
        wait_engine_idle(aengine)
        events = wait_events(p, t.name, 7)
        assert len(events) == 7
        statuses = sorted(e.status for e in events)
        assert statuses == ["aborted"] * 3 + ["completed"] * 4
        assert sum(e.completion_tokens for e in events) == counting.completion_tokens
        assert sum(e.prompt_tokens for e in events) == counting.prompt_tokens
        by_id = {e.request_id: e for e in events}
        for got, rid in aborted:
            assert by_id[rid].completion_tokens >= got


def test_usage_events_are_idempotent_by_request_id(platform):
    t = platform.tenant()
    r = platform.openai(t).chat.completions.create(model=BASE, messages=LONG, max_tokens=2)
    [event] = platform.usage_events(t.name)
    dup = Usage(request_id=r.id, tenant_id=event.tenant_id, api_key_id=event.api_key_id, model=BASE,
                adapter_version=None, priority="standard", prompt_tokens=999, completion_tokens=999,
                status="completed", finish_reason="stop", ttft_ms=1.0, duration_ms=2.0)
    assert platform.gateway.meter.record_sync(dup) is False
    [again] = platform.usage_events(t.name)
    assert again.completion_tokens == event.completion_tokens == r.usage.completion_tokens


def test_admin_usage_totals(platform):
    t = platform.tenant()
    r = platform.openai(t).chat.completions.create(model=BASE, messages=LONG, max_tokens=3)
    got = platform.admin.get(f"/admin/v1/tenants/{t.name}/usage").json()
    assert got["by_status"]["completed"] == {"requests": 1, "prompt_tokens": r.usage.prompt_tokens,
                                             "completion_tokens": r.usage.completion_tokens}


def test_a_stream_the_engine_fails_is_billed_the_tokens_its_chunks_showed(platform, aengine):
    # A long stop string holds the text back (it could be the stop string's start), so the first
    # deltas carry tokens but no text; the engine then goes away. The client saw no token.
    stop = "a stop string far longer than anything these few tokens can spell out"
    for deltas in (4, 40):
        dying = DyingEngineClient(InProcessEngineClient(aengine), deltas=deltas)
        app = create_app(platform.settings, engine_client=dying)
        with ServerThread(app) as server:
            p = Platform(server.url, platform.settings, app)
            t = p.tenant()
            body = {"model": BASE, "messages": LONG, "max_tokens": 64, "temperature": 0, "stream": True,
                    "stop": [stop], "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
            shown, error = 0, None
            with httpx.stream("POST", f"{p.url}/v1/chat/completions", json=body,
                              headers={"authorization": f"Bearer {t.key}"}, timeout=60) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        data = json.loads(line.removeprefix("data: "))
                        if "error" in data:
                            error = data["error"]
                        elif data["choices"] and data["choices"][0]["delta"].get("content"):
                            shown = data["usage"]["completion_tokens"]
            wait_engine_idle(aengine)
            [event] = wait_events(p, t.name, 1)
            assert error["code"] == "engine_unavailable" and event.status == "error"
            assert dying.completion_tokens == deltas  # the gateway got them all
            assert event.completion_tokens == shown
            if deltas == 4:
                assert shown == 0  # every token's text was still held back
            else:
                assert 0 < shown <= deltas
