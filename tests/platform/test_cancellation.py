"""Cancellation end to end, in process and over HTTP to an engine worker: a client that goes away
while its request waits for a seat, mid-prefill, mid-decode, or a non-streaming client that
times out, has its engine request aborted within one engine step of the disconnect reaching the
server that holds the engine request (KV blocks and seat free then; the engine idle again, read
from its /metrics) and is billed by the rule of docs/ARCHITECTURE.md: the prompt tokens the
engine prefilled (0 before it was scheduled), the completion tokens its chunks showed. Another
tenant's greedy stream meanwhile completes unchanged and within a bound of its idle latency.

Steps, not seconds: the gateway and the worker are served through `Watched`, which notes the
engine's step counter (`LLMEngine.stats["steps"]`, exported as tessera_engine_step_seconds_count)
when the server hands the app the client's `http.disconnect` (the earliest the app can know), and
the engine's `abort` is wrapped to note the counter, the seat and the request's KV blocks when it
is applied. The disconnect's own travel (the client's FIN to the server's event loop) is wall-clock
and the test does not bound it.

The engine here computes at most BUDGET prompt tokens per step, so the long prompt takes dozens
of steps; a client that leaves mid-prefill is a plain socket closed once the engine's computed
tokens start to grow (nothing of the response has arrived then: the gateway answers after the
first token). With nothing else running, the tokens the engine computed while the request lived
(tessera_engine_batch_tokens_sum) are exactly its prefilled prompt tokens.
"""
from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlparse

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr

from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tessera.app import create_app
from tessera.engine_client.inprocess import InProcessEngineClient
from tessera.engine_client.worker import create_worker_app

from .conftest import Platform, ServerThread
from .test_engine_resilience import _stream_text
from .test_gateway_usage import LONG, wait_events

BASE = "SmolLM2-135M-Instruct"
SECRET = "cancellation-secret-" + "c" * 16
BUDGET = 16  # prompt tokens per engine step
SEATS = 2  # sequences the engine runs at once: a third request waits for a seat
OTHER_TOKENS = 64  # the other tenant's greedy stream: long enough to hold its seat meanwhile
# The other tenant's stream, while a long prompt is prefilled beside it and requests come and go,
# takes at most OTHER_FACTOR x its idle latency (the slower of two idle runs, same gateway) +
# OTHER_MARGIN_S: each of its steps also carries up to BUDGET - 1 prompt tokens of the long prompt
# (measured on a shared 2-core machine under a load of 5-6: idle 5.5-7.6 s, beside them at most
# 1.4x idle); the margin absorbs one-off stalls of a loaded 2-core CI machine.
OTHER_FACTOR = 3.0
OTHER_MARGIN_S = 1.0
# Engine steps from the disconnect reaching the server to the abort applied (seat and blocks
# free). At most one: the step in flight when the app learns of it ends first, then the abort is
# applied before the next (engine.async_engine). Over HTTP, from the gateway's side, one more:
# a step may start while the gateway's close crosses the loopback hop to the worker (from the
# worker's side it is one again). Measured (every case, both modes, three runs): always 1.
STEPS_TO_ABORT = 1
STEPS_TO_ABORT_ACROSS_THE_HOP = 2


class Watched:
    """An ASGI app seen from the server's side: the engine's step count each time the server tells
    the app that a client whose response had not ended went away (`receive()` returning
    http.disconnect), and, per x-request-id, the response body the app handed to the server
    before that."""

    def __init__(self, app, engine: AsyncLLMEngine):
        self.app, self.engine = app, engine
        self.disconnects: list[int] = []
        self.bodies: dict[str, bytes] = {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        ended = gone = False
        request_id, body = None, bytearray()

        async def watched_receive():
            nonlocal gone
            message = await receive()
            if message["type"] == "http.disconnect" and not ended and not gone:
                gone = True
                self.disconnects.append(self.engine.engine.stats["steps"])
            return message

        async def watched_send(message):
            nonlocal ended, request_id
            if message["type"] == "http.response.start":
                request_id = dict(message.get("headers", ())).get(b"x-request-id")
            elif message["type"] == "http.response.body":
                if not gone:
                    body.extend(message.get("body", b""))
                ended = ended or not message.get("more_body", False)
            await send(message)

        try:
            await self.app(scope, watched_receive, watched_send)
        finally:
            if request_id is not None:
                self.bodies[request_id.decode()] = bytes(body)


@dataclass
class Abort:
    """An abort the engine applied: its step count then, and what it left behind."""

    request_id: str
    steps: int
    seat_free: bool  # the request is in neither the running nor the waiting queue
    blocks_left: int  # KV blocks the request still holds
    exclusive: int  # KV blocks it alone held before
    freed: int  # blocks back on the free lists by the abort


def record_aborts(engine: AsyncLLMEngine) -> list[Abort]:
    """Wrap `engine`'s LLMEngine.abort (called on its step thread, between steps) to record
    every abort that stopped a request."""
    e = engine.engine
    records: list[Abort] = []
    inner = e.abort

    def abort(request_id: str):
        seq = e.requests.get(request_id)
        free_before = e.block_manager.num_free_blocks
        exclusive = e.block_manager.num_exclusive_blocks(seq) if seq is not None else 0
        out = inner(request_id)
        if out is not None:
            sched = e.scheduler
            records.append(Abort(request_id, e.stats["steps"],
                                 seat_free=seq not in list(sched.running) and seq not in list(sched.waiting),
                                 blocks_left=len(seq.block_table), exclusive=exclusive,
                                 freed=e.block_manager.num_free_blocks - free_before))
        return out

    e.abort = abort
    return records


@pytest.fixture(scope="module")
def engine():
    e = LLMEngine(config=EngineConfig(kv_cache_bytes=128 << 20, max_num_seqs=SEATS, max_num_batched_tokens=BUDGET))
    a = AsyncLLMEngine(e)
    a.aborts = record_aborts(a)
    yield a
    a.shutdown()


@pytest.fixture(scope="module")
def worker(engine):
    """The engine's worker API over uvicorn: the HTTP mode's engine, and its /metrics in both modes
    (`watched`: the worker app as its server saw it)."""
    watched = Watched(create_worker_app(engine, secret=SECRET), engine)
    with ServerThread(watched) as server:
        server.watched = watched
        yield server


@pytest.fixture(scope="module", params=["in-process", "http"])
def gateway(request, platform_settings, engine, worker):
    if request.param == "in-process":
        settings = platform_settings
        app = create_app(settings, engine_client=InProcessEngineClient(engine))
    else:
        settings = platform_settings.model_copy(update={"engine_mode": "http", "engine_urls": [worker.url],
                                                        "engine_secret": SecretStr(SECRET)})
        app = create_app(settings)
    watched = Watched(app, engine)
    with ServerThread(watched) as server:
        p = Platform(server.url, settings, app)
        p.watched, p.mode = watched, request.param
        yield p


def timed_other_stream(gateway: Platform, tenant, started: threading.Event | None = None) -> tuple[str, float]:
    t0 = time.perf_counter()
    text = _stream_text(gateway, tenant, started, OTHER_TOKENS)
    return text, time.perf_counter() - t0


@pytest.fixture(scope="module")
def other_alone(gateway, worker):
    """The other tenant's greedy stream with the engine to itself: (its text, the slower of two
    idle runs' latency); the engine idle after."""
    tenant = gateway.tenant()
    runs = [timed_other_stream(gateway, tenant) for _ in range(2)]
    assert runs[0][0] == runs[1][0]
    wait_idle(worker)
    return runs[0][0], max(s for _, s in runs)


def engine_state(worker) -> dict[str, float]:
    """The engine's series that say what it holds: KV blocks in use, sequences running and
    waiting (all classes), and the prompt and decode tokens it has computed so far."""
    r = httpx.get(f"{worker.url}/metrics", timeout=10)
    state = {"used": 0.0, "running": 0.0, "waiting": 0.0, "computed": 0.0}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if s.name == "tessera_engine_kv_cache_blocks" and s.labels.get("state") == "used":
                state["used"] += s.value
            elif s.name == "tessera_engine_running_sequences":
                state["running"] += s.value
            elif s.name == "tessera_engine_waiting_sequences":
                state["waiting"] += s.value
            elif s.name == "tessera_engine_batch_tokens_sum":
                state["computed"] += s.value
    return state


def wait_for(worker, check, what: str, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        state = engine_state(worker)
        if check(state):
            return state
        assert time.monotonic() < deadline, f"the engine never got {what}: {state}"
        time.sleep(0.01)


def wait_idle(worker) -> dict[str, float]:
    """Block until the engine holds no KV block and no sequence, running or waiting."""
    return wait_for(worker, lambda s: s["used"] == s["running"] == s["waiting"] == 0, "idle")


class Leaving:
    """A streaming chat request sent on a plain socket, which the test closes whenever it likes:
    a client that goes away at an exact moment."""

    def __init__(self, gateway: Platform, key: str, content: str, max_tokens: int = 64):
        body = json.dumps({"model": BASE, "messages": [{"role": "user", "content": content}],
                           "max_tokens": max_tokens, "temperature": 0, "stream": True}).encode()
        url = urlparse(gateway.url)
        self.sock = socket.create_connection((url.hostname, url.port))
        self.sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nhost: {url.netloc}\r\n"
                          f"authorization: Bearer {key}\r\ncontent-type: application/json\r\n"
                          f"content-length: {len(body)}\r\n\r\n".encode() + body)

    def leave(self) -> None:
        self.sock.close()


def long_prompt() -> str:
    """About 1,000 tokens (dozens of BUDGET-token steps), unique so the prefix cache holds none."""
    return f"[{uuid.uuid4().hex}] " + "The quick brown fox jumps over the lazy dog. " * 95


def marks(gateway: Platform, worker, engine: AsyncLLMEngine) -> tuple[int, int, int]:
    """Where the disconnect and abort records stand now (for `aborted_within_a_step`)."""
    return len(gateway.watched.disconnects), len(worker.watched.disconnects), len(engine.aborts)


def aborted_within_a_step(gateway: Platform, worker, engine: AsyncLLMEngine, since: tuple[int, int, int]) -> Abort:
    """The one request aborted since `since` (after `wait_idle`): its seat and KV blocks were free
    when the abort was applied, within STEPS_TO_ABORT engine steps of the disconnect reaching the
    server that learnt of it (the gateway in process; over HTTP also the worker, where the
    gateway's close arrives, or its /internal/abort does first)."""
    g, w, a = since
    [abort] = engine.aborts[a:]
    print(f"\n{gateway.mode}: abort applied {abort.steps - gateway.watched.disconnects[g]} step(s) after the gateway "
          f"saw the disconnect (worker: {[abort.steps - seen for seen in worker.watched.disconnects[w:]]})")
    assert abort.seat_free and abort.blocks_left == 0 and abort.freed == abort.exclusive, abort
    [seen_by_gateway] = gateway.watched.disconnects[g:]
    by_worker = worker.watched.disconnects[w:]
    if gateway.mode == "in-process":
        assert by_worker == []
        assert abort.steps - seen_by_gateway <= STEPS_TO_ABORT, (abort, seen_by_gateway)
    else:
        assert len(by_worker) <= 1, by_worker
        assert abort.steps - seen_by_gateway <= STEPS_TO_ABORT_ACROSS_THE_HOP, (abort, seen_by_gateway, by_worker)
        assert all(abort.steps - seen <= STEPS_TO_ABORT for seen in by_worker), (abort, by_worker)
    return abort


def one_event(gateway: Platform, tenant_name: str):
    [event] = wait_events(gateway, tenant_name, 1)
    return event


def full_prompt_tokens(gateway: Platform, key_tenant, content: str) -> int:
    r = gateway.openai(key_tenant).chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": content}], max_tokens=1, temperature=0)
    return r.usage.prompt_tokens


def test_disconnect_mid_prefill_bills_the_prefilled_prompt(gateway, worker, engine):
    wait_idle(worker)
    t = gateway.tenant()
    before, since = engine_state(worker), marks(gateway, worker, engine)
    client = Leaving(gateway, t.key, long_prompt())
    wait_for(worker, lambda s: s["computed"] > before["computed"], "to start the prefill")
    client.leave()
    after = wait_idle(worker)
    aborted_within_a_step(gateway, worker, engine, since)
    event = one_event(gateway, t.name)
    computed = after["computed"] - before["computed"]
    assert event.status == "aborted" and event.completion_tokens == 0
    # The engine stopped within the prefill, and the tenant pays for the part it computed.
    assert event.prompt_tokens == computed
    assert 0 < computed < 900


def test_client_waiting_for_a_seat_is_billed_nothing_and_frees_it(gateway, worker, engine, other_alone):
    """Another tenant's stream and a long prompt hold both seats; a third request waits. Its client
    leaves: its seat in the queue is freed at once and nothing is billed. Then the long prompt's
    client leaves mid-prefill; the other tenant's stream is unchanged, its latency bounded."""
    wait_idle(worker)
    alone, idle_s = other_alone
    other, x, z = gateway.tenant(), gateway.tenant(), gateway.tenant()
    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(timed_other_stream, gateway, other, started)
        assert started.wait(60), "the other tenant's stream never started"
        before = engine_state(worker)
        holder = Leaving(gateway, x.key, long_prompt())
        wait_for(worker, lambda s: s["running"] == SEATS and s["computed"] > before["computed"],
                 "both seats taken")
        waiter = Leaving(gateway, z.key, long_prompt())
        wait_for(worker, lambda s: s["waiting"] == 1, "a request waiting for a seat")
        since = marks(gateway, worker, engine)
        waiter.leave()
        wait_for(worker, lambda s: s["waiting"] == 0, "the waiting request gone")
        aborted_within_a_step(gateway, worker, engine, since)
        since = marks(gateway, worker, engine)
        holder.leave()
        text, took = stream.result(timeout=120)
    wait_idle(worker)
    aborted_within_a_step(gateway, worker, engine, since)
    bound = OTHER_FACTOR * idle_s + OTHER_MARGIN_S
    print(f"\nother tenant's stream ({gateway.mode}): idle {idle_s:.3f} s, beside the cancelled requests "
          f"{took:.3f} s (bound {bound:.2f} s)")
    assert text == alone
    assert took <= bound, (took, idle_s)
    event = one_event(gateway, z.name)
    assert (event.status, event.prompt_tokens, event.completion_tokens) == ("aborted", 0, 0)
    event = one_event(gateway, x.name)
    assert event.status == "aborted" and event.completion_tokens == 0 and 0 < event.prompt_tokens < 900


def stream_and_leave(gateway: Platform, key: str, chunks: int) -> tuple[str, dict]:
    """A greedy chat stream with the usage so far on every chunk; the client reads `chunks`
    content chunks and drops the connection. Returns (request id, the usage of the last chunk read)."""
    body = {"model": BASE, "messages": LONG, "max_tokens": 200, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    got, usage = 0, None
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", f"{gateway.url}/v1/chat/completions", json=body,
                      headers={"authorization": f"Bearer {key}"}) as r:
            assert r.status_code == 200
            rid = r.headers["x-request-id"]
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    data = json.loads(line[6:])
                    if data["choices"] and data["choices"][0]["delta"].get("content"):
                        got, usage = got + 1, data["usage"]
                        if got == chunks:
                            break
    return rid, usage


def sent_usage(body: bytes) -> dict:
    """The usage on the last chunk of an SSE body (every chunk carries it: continuous_usage_stats)."""
    chunks = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: {")]
    return [c["usage"] for c in chunks if c.get("usage")][-1]


def test_disconnect_mid_decode_bills_the_prompt_and_what_was_sent(gateway, worker, engine):
    wait_idle(worker)
    t = gateway.tenant()
    prompt = full_prompt_tokens(gateway, t, LONG[0]["content"])
    since = marks(gateway, worker, engine)
    rid, read = stream_and_leave(gateway, t.key, chunks=3)
    wait_idle(worker)
    aborted_within_a_step(gateway, worker, engine, since)
    event = {e.request_id: e for e in wait_events(gateway, t.name, 2)}[rid]
    assert event.status == "aborted" and event.prompt_tokens == prompt == read["prompt_tokens"]
    # Billed: exactly the completion tokens of the chunks the gateway had written when it learnt
    # the client was gone: those the client read, and any it wrote after the client stopped
    # reading (the last of them says how many in its usage); never a token it did not send.
    sent = sent_usage(gateway.watched.bodies[rid])
    assert event.completion_tokens == sent["completion_tokens"]
    assert read["completion_tokens"] <= event.completion_tokens < 200


def test_non_streaming_client_that_times_out_is_aborted_and_billed_what_was_computed(gateway, worker, engine):
    wait_idle(worker)
    t = gateway.tenant()
    before, since = engine_state(worker), marks(gateway, worker, engine)
    with pytest.raises(openai.APITimeoutError):
        gateway.openai(t).with_options(timeout=0.5).chat.completions.create(
            model=BASE, messages=[{"role": "user", "content": long_prompt()}], max_tokens=64, temperature=0)
    after = wait_idle(worker)
    aborted_within_a_step(gateway, worker, engine, since)
    event = one_event(gateway, t.name)
    computed = after["computed"] - before["computed"]
    assert event.status == "aborted" and event.completion_tokens == 0
    assert event.prompt_tokens == computed < 900
