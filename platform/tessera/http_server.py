"""The HTTP listener every server command runs (`tessera serve`, `tessera demo`, `tessera
engine-worker`): uvicorn with Tessera's connection rules, so that what a client holds of a server
is bounded whatever it sends or does not send.

Rules (each per server process; the settings are PlatformSettings' `http_*` block):
- header read timeout: a request's line and headers must have arrived `http_header_timeout_s`
  after the connection opened (first request) or after the request's first byte (later requests
  on a kept-alive connection); else the client gets 408 and the connection is closed (after a
  lingering half-close: see `_answer_and_linger`). uvicorn has no such timeout: a client sending its
  headers a byte at a time would hold its connection forever.
- header size: more than `http_max_header_bytes` of request line and headers is a 431, closed
  (uvicorn's httptools parser has no bound of its own; h11's is set to the same).
- body read timeout: `http_body_timeout_s` after the headers, the body must have arrived at
  `http_body_min_bytes_per_s` on average (a grace, then a rate, so a large upload on a slow link
  passes and a trickle does not); else the connection is closed and the app sees a disconnect.
  Time during which the server itself paused reading (the app not reading yet) is not counted.
- connections: at most `http_max_connections` open (uvicorn's limit_concurrency too, which also
  bounds requests in flight) and at most `http_max_connections_per_address` from one client
  address (the peer's IP; the engine worker, whose clients are the gateways, applies the total
  only); a connection beyond either is answered 503 with Retry-After and closed before a byte of
  it is parsed, so one address cannot take the server's connections from everyone else. The 503
  goes out with the lingering half-close too (a client sends its request as soon as it has
  connected, and a plain close with that request unread answers it with a reset, which the client
  reads instead of the 503), for at most MAX_LINGERING_REFUSALS refused connections of a server
  at a time; beyond that (a flood) they are closed at once. A refused connection lingering does
  not count as open.
- keep-alive: an idle kept-alive connection is closed after `http_keep_alive_s`.
- a request the parser rejects: uvicorn's 400, sent with the same lingering half-close as the
  408 and 431 (not counted below: the client broke the protocol, no bound was reached).

Every close for one of these reasons counts in `tessera_http_connections_refused_total{reason}`.
A slow client costs the server a socket and a few timers, never a thread: the app runs only once
the headers are complete.
"""
from __future__ import annotations

import asyncio
import logging
import weakref
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

#: Reasons a connection is refused or closed early, the values of the counter's `reason` label.
REASONS = ("header_timeout", "header_too_large", "body_timeout", "too_many_connections", "too_many_per_address")
#: How long a connection answered 400, 408 or 431 keeps reading (and dropping) what its client still
#: sends before it is closed (unless the client closes first).
LINGER_S = 2.0
#: How many refused connections (503) of one server may linger at a time: each holds a socket for
#: at most LINGER_S, so a flood of connections costs the server at most this many more.
MAX_LINGERING_REFUSALS = 256


@dataclass(frozen=True)
class ConnectionLimits:
    """What one client may hold of a server process (see the module docstring)."""

    header_timeout_s: float
    body_timeout_s: float
    body_min_bytes_per_s: int
    keep_alive_s: float
    max_header_bytes: int
    max_connections: int
    max_connections_per_address: int  # 0: no per-address bound

    @classmethod
    def from_settings(cls, settings, *, per_address: bool = True) -> "ConnectionLimits":
        """The limits PlatformSettings' http_* fields set; `per_address=False` drops the
        per-address bound (the engine worker's clients are a few gateways)."""
        return cls(header_timeout_s=settings.http_header_timeout_s, body_timeout_s=settings.http_body_timeout_s,
                   body_min_bytes_per_s=settings.http_body_min_bytes_per_s, keep_alive_s=settings.http_keep_alive_s,
                   max_header_bytes=settings.http_max_header_bytes, max_connections=settings.http_max_connections,
                   max_connections_per_address=settings.http_max_connections_per_address if per_address else 0)


_refused_counter = None


def _count(reason: str) -> None:
    # Created on first use: `tessera serve --workers N` points prometheus-client at its multiprocess
    # folder after this module is imported.
    global _refused_counter
    if _refused_counter is None:
        from prometheus_client import Counter

        _refused_counter = Counter("tessera_http_connections_refused", "Connections refused or closed by the "
                                   "HTTP connection rules (tessera/http_server.py)", ["reason"])
    _refused_counter.labels(reason).inc()


def _plain(status: int, phrase: str, message: str, *, retry_after: bool = False) -> bytes:
    body = message.encode()
    return (f"HTTP/1.1 {status} {phrase}\r\ncontent-type: text/plain; charset=utf-8\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n" + ("retry-after: 1\r\n" if retry_after else "")
            + "\r\n").encode() + body


class GuardedHttp:
    """uvicorn's `http=` protocol factory applying `limits`. Picklable (only the limits travel), so
    `--workers N` gives each worker process its own counts of open connections per address."""

    def __init__(self, limits: ConnectionLimits):
        self.limits = limits
        self._per_server: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # server state -> _ServerCounts

    def __getstate__(self) -> dict:
        return {"limits": self.limits}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["limits"])

    def __call__(self, *, config, server_state, app_state, _loop=None) -> asyncio.Protocol:
        counts = self._per_server.setdefault(server_state, _ServerCounts())
        return _GuardedProtocol(config=config, server_state=server_state, app_state=app_state, _loop=_loop,
                                limits=self.limits, counts=counts)


class _ServerCounts:
    """What one server's connections share: its open connections per client address and its
    refused connections lingering now."""

    def __init__(self):
        self.per_address: dict[str, int] = {}
        self.lingering_refusals = 0


class _GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol plus the header/body timeouts, the header size bound and the
    connection bounds. Everything runs on the event loop: no locks."""

    def __init__(self, *, limits: ConnectionLimits, counts: _ServerCounts, **kw: Any):
        super().__init__(**kw)
        self._limits = limits
        self._counts = counts
        self._per_address = counts.per_address
        self._refused = False  # answered 503 and lingering (counted in counts.lingering_refusals)
        self._address: str | None = None  # counted in per_address while the connection is open
        self._header_timer: asyncio.TimerHandle | None = None
        self._in_headers = True
        self._header_bytes = 0
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_due = 0.0  # loop time by which the body bytes seen so far had to arrive, at rate 0
        self._linger_timer: asyncio.TimerHandle | None = None  # set once the connection is answered early

    # -- connections
    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        address = self.client[0] if self.client else None
        per_address_max = self._limits.max_connections_per_address
        if len(self.connections) > self._limits.max_connections:
            return self._refuse("too_many_connections", "the server has too many open connections; retry shortly")
        if address is not None and per_address_max and self._per_address.get(address, 0) >= per_address_max:
            return self._refuse("too_many_per_address",
                                f"too many open connections from {address} (at most {per_address_max}); "
                                "close some or retry shortly")
        if address is not None:
            self._address = address
            self._per_address[address] = self._per_address.get(address, 0) + 1
        self._arm_header_timer()

    def connection_lost(self, exc) -> None:
        super().connection_lost(exc)
        for timer in (self._header_timer, self._body_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._body_timer = self._linger_timer = None
        if self._refused:
            self._refused = False
            self._counts.lingering_refusals -= 1
        if self._address is not None:
            left = self._per_address.get(self._address, 1) - 1
            if left > 0:
                self._per_address[self._address] = left
            else:
                self._per_address.pop(self._address, None)
            self._address = None

    def _refuse(self, reason: str, message: str) -> None:
        """Count `reason` and answer 503: with the lingering half-close while fewer than
        MAX_LINGERING_REFUSALS of this server's refusals linger, else closed at once. Either way
        the connection no longer counts as open (uvicorn's set of connections)."""
        _count(reason)
        self.connections.discard(self)
        answer = _plain(503, "Service Unavailable", message, retry_after=True)
        if self._counts.lingering_refusals >= MAX_LINGERING_REFUSALS:
            self.transport.write(answer)
            self.transport.close()
            return
        self._counts.lingering_refusals += 1
        self._refused = True
        self._answer_and_linger(answer)

    # -- headers
    def data_received(self, data: bytes) -> None:
        if self._linger_timer is not None:
            return  # answered and half-closed: what the client still sends is dropped unread
        if self._in_headers:
            # Up to the blank line that ends the headers (one read may carry the body's start too);
            # checked before parsing, so headers beyond the bound are never parsed.
            end = data.find(b"\r\n\r\n")
            self._header_bytes += len(data) if end < 0 else end + 4
            if self._header_bytes > self._limits.max_header_bytes:
                return self._close_early("header_too_large", 431, "Request Header Fields Too Large",
                                         f"request line and headers are larger than {self._limits.max_header_bytes} bytes")
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_headers = True
        self._arm_header_timer()  # a first request keeps the deadline its connection started

    def on_headers_complete(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        self._in_headers, self._header_bytes = False, 0
        super().on_headers_complete()
        if any(name in (b"content-length", b"transfer-encoding") for name, _ in self.headers):
            self._body_due = self.loop.time() + self._limits.body_timeout_s
            self._body_timer = self.loop.call_at(self._body_due, self._check_body)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self._limits.header_timeout_s, self._header_timeout)

    def _header_timeout(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self._close_early("header_timeout", 408, "Request Timeout",
                              f"request headers did not arrive within {self._limits.header_timeout_s:g} s")

    # -- body
    def on_body(self, body: bytes) -> None:
        self._body_due += len(body) / self._limits.body_min_bytes_per_s
        super().on_body(body)

    def on_message_complete(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    def _check_body(self) -> None:
        self._body_timer = None
        if self.transport.is_closing():
            return
        now = self.loop.time()
        if self.flow.read_paused:
            # The server stopped reading (the app has not taken what came): not the client's delay.
            self._body_due = max(self._body_due, now) + 1.0
        if now < self._body_due:
            self._body_timer = self.loop.call_at(self._body_due, self._check_body)
            return
        _count("body_timeout")
        log.info("closing a connection from %s: its request body arrived too slowly", self._address)
        self.transport.close()  # the app, waiting on the body, receives http.disconnect

    def _close_early(self, reason: str, status: int, phrase: str, message: str) -> None:
        """Count `reason`, answer `status` and close (`_answer_and_linger`)."""
        _count(reason)
        self._answer_and_linger(_plain(status, phrase, message))

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request its parser rejects (it has logged it), sent with the
        lingering half-close of the 408 and 431 (`_answer_and_linger`): closed at once instead, a
        client still sending would often read only a reset."""
        self._answer_and_linger(_plain(400, "Bad Request", msg))

    def _answer_and_linger(self, answer: bytes) -> None:
        """Write `answer` and close; while a response of this connection is still being sent
        (pipelining), only close: the two would interleave.

        The answer goes out with a half-close: the server's side ends after it, and what the client
        still sends (the rest of its headers or body) is read and dropped for up to LINGER_S, or
        until the client closes. Closed at once, the socket would answer the client's next bytes
        (or its unread ones) with a reset, which can reach the client before it has read the
        answer, and it would see only the reset."""
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()
            return
        self.transport.write(answer)
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self._linger_timer = self.loop.call_later(LINGER_S, self.transport.close)


def server_options(settings, *, per_address: bool = True) -> dict[str, Any]:
    """uvicorn.run / uvicorn.Config keyword arguments applying the connection rules of `settings`
    (PlatformSettings); every server command passes them. `per_address=False` for the engine
    worker (see ConnectionLimits.from_settings)."""
    limits = ConnectionLimits.from_settings(settings, per_address=per_address)
    # uvicorn's limit_concurrency refuses a request while connections or tasks >= it; ours refuses
    # the connection beyond max_connections, so uvicorn's starts one later.
    return {"http": GuardedHttp(limits), "timeout_keep_alive": limits.keep_alive_s,
            "limit_concurrency": limits.max_connections + 1,
            "h11_max_incomplete_event_size": limits.max_header_bytes}
