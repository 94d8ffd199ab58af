"""Slow clients against a real `tessera serve` process (tessera/http_server.py): 200 connections
sending their headers a byte at a time, each from its own loopback address, do not delay another
tenant's request nor change its greedy output, and the server closes every one of them once the
header timeout has passed (408, read by the client even while it is still sending; likewise the
400 of a malformed request with a body behind it); one address cannot hold more than its share of
connections while another address is still served."""
from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import pytest

from adapter_registry.migrate import upgrade
from adapter_registry.settings import RegistrySettings

from .chaos_helpers import TESSERA, Service, free_port

ADMIN_TOKEN = "slow-clients-admin-" + "x" * 16
HEADER_TIMEOUT_S = 5.0
PER_ADDRESS = 8
SLOW_CLIENTS = 200
QUESTION = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    root = tmp_path_factory.mktemp("slow-clients")
    db = f"sqlite:///{root}/tessera.db"
    upgrade(RegistrySettings(database_url=db))
    port = free_port()
    service = Service("gateway", [TESSERA, "serve"], cwd=root, settings={
        "database_url": db, "object_store_root": root / "objects", "adapter_cache_dir": root / "cache",
        "usage_outbox_dir": root / "outbox", "port": port, "admin_token": ADMIN_TOKEN,
        "engine_threads": 2, "engine_kv_cache_mib": 64,
        "http_header_timeout_s": HEADER_TIMEOUT_S, "http_max_connections_per_address": PER_ADDRESS}).start()
    url = f"http://127.0.0.1:{port}"
    try:
        service.wait_until_answers(f"{url}/ready")
        yield url, port
    finally:
        service.stop()


def new_key(url: str) -> str:
    name = "slow-" + uuid.uuid4().hex[:8]
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30) as admin:
        assert admin.put(f"/admin/v1/plans/{name}", json={"requests_per_minute": 1000}).status_code == 200
        assert admin.post("/admin/v1/tenants", json={"name": name, "plan": name}).status_code == 201
        r = admin.post(f"/admin/v1/tenants/{name}/keys", json={"name": "k"})
    assert r.status_code == 201, r.text
    return r.json()["key"]


def greedy(url: str, key: str) -> tuple[str, float]:
    """(the text, seconds) of one greedy chat through the openai client."""
    import openai

    with openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60) as client:
        start = time.monotonic()
        r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=QUESTION, max_tokens=12,
                                           temperature=0)
    return r.choices[0].message.content, time.monotonic() - start


async def answer_of(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    """All the server sends until it closes, or the name of the error the client gets instead."""
    try:
        return await asyncio.wait_for(reader.read(), timeout=timeout_s)
    except (ConnectionError, asyncio.TimeoutError) as e:
        return type(e).__name__.encode()


async def dripping_client(port: int, source: str, headers: bytes, interval_s: float,
                          opened: list | None = None, closed: dict | None = None) -> bytes:
    """Connect from `source`, then send `headers` a byte every `interval_s`, never ending them;
    what the server answers (or the error the client gets), recorded with its seconds from the
    connection in `closed` (and the source in `opened` once connected) where given."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    if opened is not None:
        opened.append(source)
    start = time.monotonic()

    async def drip():
        for b in headers:
            writer.write(bytes([b]))
            await asyncio.sleep(interval_s)

    dripping = asyncio.ensure_future(drip())
    answer = await answer_of(reader, HEADER_TIMEOUT_S + 20)
    if closed is not None:
        closed[source] = (time.monotonic() - start, answer)
    dripping.cancel()
    writer.close()
    return answer


#: A request whose headers end in time but hold a line that is not a header (1 MB of body follows).
BAD_HEADER = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: 1048576\r\nthis is not a header\r\n\r\n")
SLOW_HEADERS = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n" * 40


def test_slow_headers_do_not_delay_another_tenant_and_are_closed(gateway):
    url, port = gateway
    key = new_key(url)
    greedy(url, key)  # warm: the first request pays one-time costs
    idle = [greedy(url, key) for _ in range(3)]
    expected, idle_s = idle[0][0], min(s for _, s in idle)
    assert all(text == expected for text, _ in idle)

    async def scenario():
        opened, closed = [], {}
        sources = [f"127.0.{1 + i // 250}.{2 + i % 250}" for i in range(SLOW_CLIENTS)]
        clients = [asyncio.ensure_future(dripping_client(port, s, SLOW_HEADERS, 0.1, opened, closed)) for s in sources]
        while len(opened) < SLOW_CLIENTS:
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # every slow client is mid-headers now
        assert not closed, "a slow client was closed before the header timeout"
        under_load = [await asyncio.to_thread(greedy, url, key) for _ in range(3)]
        assert not closed, "the slow clients must still be open while the other tenant is served"
        await asyncio.gather(*clients)
        return under_load, closed

    under_load, closed = asyncio.run(scenario())
    for text, seconds in under_load:
        assert text == expected
        assert seconds <= 3 * idle_s + 0.5, f"{seconds:.2f}s under slow clients vs {idle_s:.2f}s idle"
    assert len(closed) == SLOW_CLIENTS
    for source, (seconds, answer) in closed.items():
        assert answer.startswith(b"HTTP/1.1 408 "), (source, answer[:80])
        assert HEADER_TIMEOUT_S - 0.5 <= seconds <= HEADER_TIMEOUT_S + 5, (source, seconds)
    # The server holds no slow connection now; its tenants are served as before.
    assert greedy(url, key)[0] == expected
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert 'tessera_http_connections_refused_total{reason="header_timeout"}' in metrics


def test_a_client_still_sending_reads_its_408_not_a_reset(gateway):
    """The 408 goes out with a half-close and the server drops what the client still sends until it
    closes: closed at once, the server's socket would answer the client's next bytes with a reset,
    which can reach the client before the 408 and leave it only a reset to read."""
    _, port = gateway
    sources = [f"127.0.3.{2 + i}" for i in range(50)]

    async def scenario():
        # header lines a byte every 2 ms: still sending when the header timeout answers
        headers = b"POST /v1/chat/completions HTTP/1.1\r\n" + b"x-slow: y\r\n" * 1000
        return await asyncio.gather(*(dripping_client(port, s, headers, 0.002) for s in sources))

    answers = asyncio.run(scenario())
    assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers), sorted({a[:24] for a in answers})


def test_a_malformed_request_with_a_body_reads_its_400_not_a_reset(gateway):
    """A request the parser rejects is answered uvicorn's 400 with the same half-close: a client
    whose request has a malformed header and a large body behind it reads the 400, where a plain
    close with the body still unread makes the server's kernel send a reset that can reach the
    client first; the server serves others meanwhile."""
    url, port = gateway
    sources = [f"127.0.4.{2 + i}" for i in range(50)]

    async def sending_client(source: str) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        writer.write(BAD_HEADER + b"x" * (1 << 20))
        answer = await answer_of(reader, 30)
        writer.close()
        return answer

    async def scenario():
        return await asyncio.gather(*(sending_client(s) for s in sources))

    answers = asyncio.run(scenario())
    assert all(a.startswith(b"HTTP/1.1 400 ") for a in answers), sorted({a[:24] for a in answers})
    assert all(a.endswith(b"Invalid HTTP request received.") for a in answers), answers[0]
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200


def test_clients_refused_over_the_bound_read_the_503_not_a_reset(gateway):
    """A client sends its request as soon as it has connected: refused over the per-address bound,
    50 httpx clients posting a chat completion each read the 503 and its message (closed at once
    with the request unread, every one of them read a reset instead); the address is served again
    once its connections close."""
    url, port = gateway
    body = {"model": "base", "messages": [{"role": "user", "content": "hi " * 2000}]}

    async def refused_client() -> str:
        transport = httpx.AsyncHTTPTransport(local_address="127.0.3.5", retries=0)
        async with httpx.AsyncClient(transport=transport) as c:
            try:
                r = await c.post(f"{url}/v1/chat/completions", json=body, timeout=10)
            except httpx.TransportError as e:
                return type(e).__name__
            return f"{r.status_code} {r.headers.get('retry-after')} {r.text}"

    async def scenario():
        held = [await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.3.5", 0))
                for _ in range(PER_ADDRESS)]
        answers = await asyncio.gather(*(refused_client() for _ in range(50)))
        for _, w in held:
            w.close()
        await asyncio.sleep(0.3)
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(local_address="127.0.3.5")) as c:
            again = (await c.get(f"{url}/health", timeout=10)).status_code
        return answers, again

    answers, again = asyncio.run(scenario())
    expected = "503 1 too many open connections from 127.0.3.5 (at most 8); close some or retry shortly"
    assert all(a == expected for a in answers), sorted(set(answers))
    assert again == 200


def test_one_address_is_bounded_while_another_is_served(gateway):
    url, port = gateway

    async def scenario():
        held = [await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.3.1", 0))
                for _ in range(PER_ADDRESS)]
        # One more from the same address: answered 503 at once, before it sent anything.
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.3.1", 0))
        refused = await asyncio.wait_for(reader.read(), timeout=10)
        writer.close()
        # Another address is served meanwhile.
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(local_address="127.0.3.2")) as c:
            other = (await c.get(f"{url}/health", timeout=10)).status_code
        for _, w in held:
            w.close()
        await asyncio.sleep(0.3)
        # The address's connections closed, it is served again.
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(local_address="127.0.3.1")) as c:
            again = (await c.get(f"{url}/health", timeout=10)).status_code
        return refused, other, again

    refused, other, again = asyncio.run(scenario())
    assert refused.startswith(b"HTTP/1.1 503 ") and b"too many open connections from 127.0.3.1" in refused
    assert b"retry-after: 1" in refused
    assert (other, again) == (200, 200)
