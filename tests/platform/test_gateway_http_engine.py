"""The HTTP engine client against a real engine worker (worker.py's internal API over uvicorn):
same answers as in-process, streaming and not; the shared secret; a disconnect aborts the engine
request through both hops; an unreachable or hung engine gives the caller a 503, not a hang."""
from __future__ import annotations

import socket
import threading

import httpx
import openai
import pytest

from tessera.app import create_app
from tessera.engine_client.worker import create_worker_app

from .conftest import Platform, ServerThread, free_port, wait_engine_idle
from .test_gateway_usage import free_blocks, stream_and_disconnect, wait_events

BASE = "SmolLM2-135M-Instruct"
SECRET = "engine-secret-" + "s" * 20
MSGS = [{"role": "user", "content": "What is the capital of Italy?"}]


@pytest.fixture(scope="module")
def worker(aengine):
    with ServerThread(create_worker_app(aengine, secret=SECRET)) as server:
        yield server


def gateway_for(platform, urls, **over):
    settings = platform.settings.model_copy(update={"engine_mode": "http", "engine_urls": urls,
                                                    "engine_secret": SECRET} | over)
    # model_copy skips validation: the secret must be a SecretStr like env-loaded settings.
    from pydantic import SecretStr

    settings = settings.model_copy(update={"engine_secret": SecretStr(SECRET)})
    app = create_app(settings)
    return app, settings


def test_worker_requires_the_shared_secret(worker):
    r = httpx.get(f"{worker.url}/internal/info")
    assert r.status_code == 401
    r = httpx.get(f"{worker.url}/internal/info", headers={"authorization": "Bearer wrong"})
    assert r.status_code == 401
    r = httpx.get(f"{worker.url}/internal/info", headers={"authorization": f"Bearer {SECRET}"})
    assert r.status_code == 200 and r.json()["model"] == BASE


def test_same_answers_over_http_as_in_process(platform, worker, aengine):
    app, settings = gateway_for(platform, [worker.url])
    t = platform.tenant()

    def prime(client):  # every compared answer starts from the same (cached) prompt blocks
        client.chat.completions.create(model=BASE, messages=MSGS, max_tokens=1, temperature=0)

    prime(platform.openai(t))
    direct = platform.openai(t).chat.completions.create(model=BASE, messages=MSGS, max_tokens=8, temperature=0)
    with ServerThread(app) as server:
        p = Platform(server.url, settings, app)
        client = p.openai(t)
        prime(client)
        r = client.chat.completions.create(model=BASE, messages=MSGS, max_tokens=8, temperature=0)
        assert r.choices[0].message.content == direct.choices[0].message.content
        # The same counts (the second request may find the prompt in the prefix cache).
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (
            direct.usage.prompt_tokens, direct.usage.completion_tokens)
        chunks = list(client.chat.completions.create(model=BASE, messages=MSGS, max_tokens=8, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
        with pytest.raises(openai.BadRequestError) as e:  # the engine's refusal crosses the hop as a 400
            client.completions.create(model=BASE, prompt=[10**9], max_tokens=2)
        assert e.value.body["param"] == "prompt"

        # A disconnect aborts the request in the worker's engine.
        wait_engine_idle(aengine)
        total = free_blocks(aengine)
        got, rid = stream_and_disconnect(server.url, t.key, chunks=2, max_tokens=200)
        wait_engine_idle(aengine)
        assert free_blocks(aengine) == total
        event = {e.request_id: e for e in wait_events(p, t.name, 6)}[rid]  # 2 primes, 3 answers, this one
        assert event.status == "aborted" and got <= event.completion_tokens < 200


def test_unreachable_engine_is_a_503(platform):
    app, settings = gateway_for(platform, [f"http://127.0.0.1:{free_port()}"], engine_connect_timeout_s=1.0)
    with ServerThread(app) as server:
        p = Platform(server.url, settings, app)
        t = platform.tenant()
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as e:
                r = p.openai(t).chat.completions.create(model=BASE, messages=MSGS, max_tokens=2, stream=stream)
                list(r) if stream else None
            assert e.value.status_code == 503 and e.value.body["code"] == "engine_unavailable"
        assert {e.status for e in platform.usage_events(t.name)} == {"error"}


def test_hung_engine_is_a_503_after_the_read_timeout(platform):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    held = []
    stop = threading.Event()

    def accept():  # accepts connections and never answers: an engine that hangs
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                pass

    threading.Thread(target=accept, daemon=True).start()
    try:
        app, settings = gateway_for(platform, [f"http://127.0.0.1:{listener.getsockname()[1]}"],
                                    engine_read_timeout_s=1.0)
        with ServerThread(app) as server:
            p = Platform(server.url, settings, app)
            t = platform.tenant()
            with pytest.raises(openai.InternalServerError) as e:
                p.openai(t).chat.completions.create(model=BASE, messages=MSGS, max_tokens=2)
            assert e.value.status_code == 503
    finally:
        stop.set()
        for c in held:
            c.close()
        listener.close()


def test_dead_in_process_engine_is_a_503(platform, aengine):
    """The in-process client over an engine loop that has stopped: 503 at once, streaming or not."""
    from engine.async_engine import AsyncLLMEngine
    from tessera.engine_client.inprocess import InProcessEngineClient

    wait_engine_idle(aengine)
    loop = AsyncLLMEngine(aengine.engine)  # a second loop over the idle engine, stopped below
    app = create_app(platform.settings, engine_client=InProcessEngineClient(loop))
    with ServerThread(app) as server:
        loop.shutdown()
        p = Platform(server.url, platform.settings, app)
        t = platform.tenant()
        for stream in (False, True):
            with pytest.raises(openai.InternalServerError) as e:
                r = p.openai(t).chat.completions.create(model=BASE, messages=MSGS, max_tokens=2, stream=stream)
                list(r) if stream else None
            assert e.value.status_code == 503 and "engine" in e.value.body["message"]
    # The shared engine still serves.
    assert platform.openai(t).chat.completions.create(model=BASE, messages=MSGS, max_tokens=1).choices


def test_ready_reflects_the_engine_workers_without_naming_them(platform, worker):
    dead = f"http://127.0.0.1:{free_port()}"
    app, settings = gateway_for(platform, [dead, worker.url])
    with ServerThread(app) as server:
        r = httpx.get(f"{server.url}/ready", timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["engine"]["engines"] == {"worker-0": "unreachable", "worker-1": "ready"}
    app, settings = gateway_for(platform, [dead])
    with ServerThread(app) as server:
        r = httpx.get(f"{server.url}/ready", timeout=30)
        assert r.status_code == 503 and r.json()["status"] == "not_ready"
        assert "worker-0: unreachable" in r.json()["reason"] and "127.0.0.1" not in r.text
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200  # alive, not ready
