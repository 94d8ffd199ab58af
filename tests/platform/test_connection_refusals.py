"""tessera.http_server's refusals under a flood, on an in-process uvicorn server with the rules
(the gateway's own tests, test_slow_clients.py, run `tessera serve` in a subprocess and cannot
see the server's counts): every connection over the per-address bound reads its 503, at most
MAX_LINGERING_REFUSALS of them hold a socket on the server at a time, and none is held once
their clients have gone."""
from __future__ import annotations

import asyncio

import uvicorn

from tessera import http_server
from tessera.http_server import ConnectionLimits, GuardedHttp

from .chaos_helpers import free_port


async def _app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


def test_a_flood_of_refused_connections_holds_at_most_the_bound_and_every_client_reads_its_503():
    limits = ConnectionLimits(header_timeout_s=10, body_timeout_s=10, body_min_bytes_per_s=1, keep_alive_s=10,
                              max_header_bytes=8192, max_connections=4096, max_connections_per_address=1)
    http = GuardedHttp(limits)
    port = free_port()
    flood = http_server.MAX_LINGERING_REFUSALS + 40

    async def scenario():
        server = uvicorn.Server(uvicorn.Config(_app, host="127.0.0.1", port=port, http=http, lifespan="off",
                                               log_level="warning", limit_concurrency=limits.max_connections + 1))
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        held = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.5.1", 0))
        refused = [await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.5.1", 0))
                   for _ in range(flood)]
        answers = [await asyncio.wait_for(reader.read(), timeout=10) for reader, _ in refused]
        counts = next(iter(http._per_server.values()))
        lingering_while_open = counts.lingering_refusals
        for _, writer in refused:
            writer.close()
        await asyncio.sleep(0.5)
        lingering_after = counts.lingering_refusals
        # The address's one connection is still served meanwhile.
        reader, writer = held
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        served = await asyncio.wait_for(reader.readuntil(b"ok"), timeout=10)
        writer.close()
        server.should_exit = True
        await serving
        return answers, lingering_while_open, lingering_after, served

    answers, lingering_while_open, lingering_after, served = asyncio.run(scenario())
    assert all(a.startswith(b"HTTP/1.1 503 ") and b"too many open connections from 127.0.5.1" in a for a in answers)
    assert lingering_while_open == http_server.MAX_LINGERING_REFUSALS
    assert lingering_after == 0
    assert served.startswith(b"HTTP/1.1 200 ")
