"""One usage event per request, whatever ends it: a completion answered as JSON or as an SSE stream
records its usage exactly once (one `Meter.record` call, not just one row: rows are deduplicated by
request id) when it completes, when the engine fails mid-request (the engine going away, or a
choice's error delta) and when its client goes away, with the billed tokens of each ending."""
from __future__ import annotations

import dataclasses
import json
import re
import time
from collections import Counter

import httpx
import pytest

from tessera.app import create_app
from tessera.engine_client.inprocess import InProcessEngineClient

from .conftest import Platform, ServerThread, wait_engine_idle
from .test_gateway_usage import BASE, LONG, CountingEngineClient, DyingEngineClient, wait_events


class FailingEngineClient(CountingEngineClient):
    """The real in-process client whose engine fails the request (an error delta, as a step fault
    traced to it) in place of its `deltas`-th delta."""

    def __init__(self, inner, deltas: int):
        super().__init__(inner)
        self.deltas = deltas

    async def generate(self, request):
        n = 0
        async for out in super().generate(request):
            n += 1
            if n == self.deltas:
                out = dataclasses.replace(out, text="", finished=True, finish_reason="error", error="a step fault")
            yield out
            if out.finished:
                return


class MeteredGateway:
    """A gateway over `client` whose meter counts its `record` calls per request id."""

    def __init__(self, platform, client):
        self.client, self.settings = client, platform.settings
        self.app = create_app(platform.settings, engine_client=client)
        self.server = ServerThread(self.app)
        self.records: Counter[str] = Counter()

    def __enter__(self) -> "MeteredGateway":
        self.server.__enter__()
        self.platform = Platform(self.server.url, self.settings, self.app)
        meter = self.app.state.gateway.meter
        record = meter.record

        async def counted(usage):
            self.records[usage.request_id] += 1
            return await record(usage)

        meter.record = counted
        self.tenant = self.platform.tenant()
        return self

    def __exit__(self, *exc) -> None:
        self.server.__exit__(*exc)

    def post(self, body: dict, **kw) -> httpx.Response:
        return httpx.post(f"{self.platform.url}/v1/chat/completions", json={"model": BASE, **body},
                          headers={"authorization": f"Bearer {self.tenant.key}"}, timeout=kw.pop("timeout", 60), **kw)

    def stream(self, body: dict, *, leave_after: int | None = None) -> tuple[str, list[dict]]:
        """(the request id, the stream's data objects); with `leave_after`, the connection is
        dropped after that many content chunks."""
        got, content = [], 0
        with httpx.stream("POST", f"{self.platform.url}/v1/chat/completions",
                          json={"model": BASE, "stream": True, **body},
                          headers={"authorization": f"Bearer {self.tenant.key}"}, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    got.append(json.loads(line.removeprefix("data: ")))
                    choices = got[-1].get("choices")
                    content += bool(choices and choices[0]["delta"].get("content"))
                    if content == leave_after:
                        break
            return r.headers["x-request-id"], got

    def event(self, rid: str):
        """The request's one usage event, after checking it was recorded exactly once."""
        wait_engine_idle(self.client.inner.aengine)
        deadline = time.monotonic() + 30
        while not (events := [e for e in self.platform.usage_events(self.tenant.name) if e.request_id == rid]):
            assert time.monotonic() < deadline, f"no usage event for {rid}"
            time.sleep(0.05)
        [event] = events
        assert self.records[rid] == 1, f"usage recorded {self.records[rid]} times"
        return event


def request_id(r: httpx.Response) -> str:
    """The request id an error answer names."""
    return re.search(r"request id ([\w-]+)\)", r.json()["error"]["message"]).group(1)


STREAM_USAGE = {"include_usage": True, "continuous_usage_stats": True}


@pytest.mark.parametrize("n", [1, 2])
def test_a_completed_request_is_billed_once_for_every_token(platform, aengine, n):
    counting = CountingEngineClient(InProcessEngineClient(aengine))
    with MeteredGateway(platform, counting) as gw:
        body = {"messages": LONG, "max_tokens": 8, "temperature": 0, "n": n}
        r = gw.post(body)
        assert r.status_code == 200
        event = gw.event(r.json()["id"])
        assert event.status == "completed" and event.finish_reason == "length"
        assert event.completion_tokens == r.json()["usage"]["completion_tokens"] == 8 * n

        rid, chunks = gw.stream({**body, "stream_options": STREAM_USAGE})
        event = gw.event(rid)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8 * n
        assert event.status == "completed" and event.finish_reason == "length"
        assert event.completion_tokens == 8 * n
        assert counting.completion_tokens == 16 * n  # every token the engine made, billed


def test_an_engine_gone_mid_request_is_billed_once(platform, aengine):
    dying = DyingEngineClient(InProcessEngineClient(aengine), deltas=6)
    with MeteredGateway(platform, dying) as gw:
        body = {"messages": LONG, "max_tokens": 64, "temperature": 0}
        r = gw.post(body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        event = gw.event(request_id(r))
        # A JSON answer on a server error is billed every token the engine made (none was sent).
        assert event.status == "error" and event.finish_reason is None and event.completion_tokens == 6

        rid, chunks = gw.stream({**body, "stream_options": STREAM_USAGE})
        assert chunks[-1]["error"]["code"] == "engine_unavailable"
        shown = max(c["usage"]["completion_tokens"] for c in chunks[:-1])
        event = gw.event(rid)
        assert event.status == "error" and event.finish_reason is None
        assert event.completion_tokens == shown and 0 < shown <= 6  # what the stream's chunks showed


def test_an_engine_error_delta_is_billed_once(platform, aengine):
    failing = FailingEngineClient(InProcessEngineClient(aengine), deltas=6)
    with MeteredGateway(platform, failing) as gw:
        body = {"messages": LONG, "max_tokens": 64, "temperature": 0}
        r = gw.post(body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_error"
        event = gw.event(request_id(r))
        assert event.status == "error" and event.finish_reason == "error"
        assert event.completion_tokens == failing.completion_tokens == 6

        rid, chunks = gw.stream({**body, "stream_options": STREAM_USAGE})
        assert chunks[-1]["error"]["code"] == "engine_error"
        shown = max(c["usage"]["completion_tokens"] for c in chunks[:-1])
        event = gw.event(rid)
        assert event.status == "error" and event.finish_reason == "error"
        assert event.completion_tokens == shown and 0 < shown <= 5  # the failed delta's token not shown


def test_a_client_gone_mid_request_is_billed_once(platform, aengine):
    counting = CountingEngineClient(InProcessEngineClient(aengine))
    with MeteredGateway(platform, counting) as gw:
        body = {"messages": LONG, "max_tokens": 400, "temperature": 0}
        with pytest.raises(httpx.ReadTimeout):  # leaving closes the connection
            gw.post(body, timeout=httpx.Timeout(60, read=0.5))
        wait_engine_idle(aengine)
        [event] = wait_events(gw.platform, gw.tenant.name, 1)
        assert gw.records[event.request_id] == 1
        # A JSON answer never sent: no completion billed.
        assert event.status == "aborted" and event.finish_reason is None and event.completion_tokens == 0

        rid, chunks = gw.stream({**body, "stream_options": STREAM_USAGE}, leave_after=3)
        shown = chunks[-1]["usage"]["completion_tokens"]
        event = gw.event(rid)
        assert event.status == "aborted" and event.finish_reason == "abort"
        assert shown <= event.completion_tokens < 400  # the chunks written, at least those read
