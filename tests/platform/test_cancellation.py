"""Cancellation end to end, in process and over HTTP to an engine worker: a client that goes away
while its request waits for a seat, mid-prefill, mid-decode, or a non-streaming client that
times out, has its engine request aborted at once (KV blocks and seats back to idle, read from
the engine's /metrics) and is billed by the rule of docs/ARCHITECTURE.md: the prompt tokens the
engine prefilled (0 before it was scheduled), the completion tokens it was sent. Another
tenant's greedy stream meanwhile completes unchanged.

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
from .test_gateway_usage import LONG, stream_and_disconnect, wait_events

BASE = "SmolLM2-135M-Instruct"
SECRET = "cancellation-secret-" + "c" * 16
BUDGET = 16  # prompt tokens per engine step
SEATS = 2  # sequences the engine runs at once: a third request waits for a seat
OTHER_TOKENS = 64  # the other tenant's greedy stream: long enough to hold its seat meanwhile


@pytest.fixture(scope="module")
def engine():
    e = LLMEngine(config=EngineConfig(kv_cache_bytes=128 << 20, max_num_seqs=SEATS, max_num_batched_tokens=BUDGET))
    a = AsyncLLMEngine(e)
    yield a
    a.shutdown()


@pytest.fixture(scope="module")
def worker(engine):
    """The engine's worker API over uvicorn: the HTTP mode's engine, and its /metrics in both modes."""
    with ServerThread(create_worker_app(engine, secret=SECRET)) as server:
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
    with ServerThread(app) as server:
        yield Platform(server.url, settings, app)


@pytest.fixture(scope="module")
def other_alone(gateway, worker):
    """The other tenant's greedy stream with the engine to itself (and an idle engine after)."""
    text = _stream_text(gateway, gateway.tenant(), max_tokens=OTHER_TOKENS)
    wait_idle(worker)
    return text


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


def one_event(gateway: Platform, tenant_name: str):
    [event] = wait_events(gateway, tenant_name, 1)
    return event


def full_prompt_tokens(gateway: Platform, key_tenant, content: str) -> int:
    r = gateway.openai(key_tenant).chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": content}], max_tokens=1, temperature=0)
    return r.usage.prompt_tokens


def test_disconnect_mid_prefill_bills_the_prefilled_prompt(gateway, worker):
    wait_idle(worker)
    t = gateway.tenant()
    before = engine_state(worker)
    client = Leaving(gateway, t.key, long_prompt())
    wait_for(worker, lambda s: s["computed"] > before["computed"], "to start the prefill")
    client.leave()
    after = wait_idle(worker)
    event = one_event(gateway, t.name)
    computed = after["computed"] - before["computed"]
    assert event.status == "aborted" and event.completion_tokens == 0
    # The engine stopped within the prefill, and the tenant pays for the part it computed.
    assert event.prompt_tokens == computed
    assert 0 < computed < 900


def test_client_waiting_for_a_seat_is_billed_nothing_and_frees_it(gateway, worker, other_alone):
    """Another tenant's stream and a long prompt hold both seats; a third request waits. Its client
    leaves: its seat in the queue is freed at once and nothing is billed. Then the long prompt's
    client leaves mid-prefill; the other tenant's stream is unchanged."""
    wait_idle(worker)
    other, x, z = gateway.tenant(), gateway.tenant(), gateway.tenant()
    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(_stream_text, gateway, other, started, OTHER_TOKENS)
        assert started.wait(60), "the other tenant's stream never started"
        before = engine_state(worker)
        holder = Leaving(gateway, x.key, long_prompt())
        wait_for(worker, lambda s: s["running"] == SEATS and s["computed"] > before["computed"],
                 "both seats taken")
        waiter = Leaving(gateway, z.key, long_prompt())
        wait_for(worker, lambda s: s["waiting"] == 1, "a request waiting for a seat")
        waiter.leave()
        wait_for(worker, lambda s: s["waiting"] == 0, "the waiting request gone")
        holder.leave()
        assert stream.result(timeout=120) == other_alone
    wait_idle(worker)
    event = one_event(gateway, z.name)
    assert (event.status, event.prompt_tokens, event.completion_tokens) == ("aborted", 0, 0)
    event = one_event(gateway, x.name)
    assert event.status == "aborted" and event.completion_tokens == 0 and 0 < event.prompt_tokens < 900


def test_disconnect_mid_decode_bills_the_prompt_and_what_was_sent(gateway, worker):
    wait_idle(worker)
    t = gateway.tenant()
    prompt = full_prompt_tokens(gateway, t, LONG[0]["content"])
    got, rid = stream_and_disconnect(gateway.url, t.key, chunks=3, max_tokens=200)
    wait_idle(worker)
    event = {e.request_id: e for e in wait_events(gateway, t.name, 2)}[rid]
    assert event.status == "aborted" and event.prompt_tokens == prompt
    assert got <= event.completion_tokens < 200


def test_non_streaming_client_that_times_out_is_aborted_and_billed_what_was_computed(gateway, worker):
    wait_idle(worker)
    t = gateway.tenant()
    before = engine_state(worker)
    with pytest.raises(openai.APITimeoutError):
        gateway.openai(t).with_options(timeout=0.5).chat.completions.create(
            model=BASE, messages=[{"role": "user", "content": long_prompt()}], max_tokens=64, temperature=0)
    after = wait_idle(worker)
    event = one_event(gateway, t.name)
    computed = after["computed"] - before["computed"]
    assert event.status == "aborted" and event.completion_tokens == 0
    assert event.prompt_tokens == computed < 900
