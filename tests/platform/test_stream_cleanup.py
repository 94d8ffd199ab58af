"""A streaming answer's producer always runs its cleanup (abort the engine request, record the
usage), also when the client is gone before the response's headers could be sent."""
from __future__ import annotations

import anyio

from tessera.streaming import DisconnectAwareStream, Final


def _body(log: list[str]):
    async def body():
        try:
            log.append("started")
            yield b"data: 1\n\n"
            yield Final(b"data: 2\n\n")
        finally:
            log.append("cleaned up")
    return body()


async def _gone(*_):
    return {"type": "http.disconnect"}


def test_the_body_cleans_up_when_the_client_is_gone_before_the_headers_are_sent():
    log: list[str] = []
    sent: list[dict] = []

    async def send(message: dict) -> None:
        await anyio.sleep(0)  # the server's write: the disconnect is noticed meanwhile
        sent.append(message)  # a server drops writes to a closed connection silently

    async def run():
        await DisconnectAwareStream(_body(log), media_type="text/event-stream")({"type": "http"}, _gone, send)

    anyio.run(run)
    assert log == ["started", "cleaned up"]


def test_a_served_body_is_sent_whole_and_cleaned_up():
    log: list[str] = []
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def wait_forever(*_):
        await anyio.sleep_forever()

    async def run():
        await DisconnectAwareStream(_body(log), media_type="text/event-stream")({"type": "http"}, wait_forever, send)

    anyio.run(run)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body", "http.response.body"]
    assert b"".join(m["body"] for m in sent[1:]) == b"data: 1\n\ndata: 2\n\n" and not sent[-1]["more_body"]
    assert log == ["started", "cleaned up"]
