"""In-process quota counters (embedded mode: one gateway process). A lock makes check-and-count
one step even when called from several threads."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from tessera.billing.periods import Period
from tessera.quota import Decision, Limits, Reservation, decide, minute_of, month_of, sliding_estimate


@dataclass
class _Counters:
    minute: int = -1
    requests: int = 0
    tokens: int = 0
    prev_requests: int = 0  # the previous minute's counts (the sliding window's tail)
    prev_tokens: int = 0
    inflight: set[str] = field(default_factory=set)
    budget: dict[Period, int] = field(default_factory=dict)  # month -> tokens reserved or used


def _window(c: _Counters, minute: int) -> tuple[int, int, int, int]:
    """(previous minute's requests, tokens, this minute's requests, tokens) as seen at `minute`."""
    if c.minute == minute:
        return c.prev_requests, c.prev_tokens, c.requests, c.tokens
    if c.minute == minute - 1:
        return c.requests, c.tokens, 0, 0
    return 0, 0, 0, 0


def _reason(limits: Limits, tokens: int, now: float, *, spent: int, inflight: int, requests: int, used: int,
            prev_requests: int, prev_used: int) -> str | None:
    """Which limit one more request of `tokens` would break (checked in this order), or None."""
    if limits.monthly_token_budget is not None and spent + tokens > limits.monthly_token_budget:
        return "budget"
    if limits.max_concurrent_requests is not None and inflight + 1 > limits.max_concurrent_requests:
        return "concurrency"
    if (limits.requests_per_minute is not None
            and sliding_estimate(prev_requests, requests, now) + 1 > limits.requests_per_minute):
        return "requests"
    if limits.tokens_per_minute is not None and sliding_estimate(prev_used, used, now) + tokens > limits.tokens_per_minute:
        return "tokens"
    return None


class MemoryQuota:
    """QuotaBackend over dicts in this process; lost on restart (budgets restart at zero)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tenants: dict[str, _Counters] = {}

    async def reserve(self, *, tenant: str, request_id: str, limits: Limits, tokens: int,
                      now: float | None = None) -> Decision:
        now = time.time() if now is None else now
        minute, month = minute_of(now), month_of(now)
        with self._lock:
            c = self._tenants.setdefault(tenant, _Counters())
            if c.minute != minute:
                c.prev_requests, c.prev_tokens, c.requests, c.tokens = _window(c, minute)
                c.minute = minute
            spent = c.budget.get(month, 0)
            reason = _reason(limits, tokens, now, spent=spent, inflight=len(c.inflight), requests=c.requests,
                             used=c.tokens, prev_requests=c.prev_requests, prev_used=c.prev_tokens)
            reservation = None
            if reason is None:
                c.requests += 1
                c.tokens += tokens
                c.inflight.add(request_id)
                c.budget[month] = spent + tokens
                reservation = Reservation(tenant, request_id, tokens, minute, month)
            return decide(reason=reason, reservation=reservation, limits=limits, now=now,
                          requests=c.requests, tokens_used=c.tokens, prev_requests=c.prev_requests,
                          prev_tokens=c.prev_tokens, tokens=tokens)

    async def peek(self, *, tenant: str, limits: Limits, tokens: int, now: float | None = None) -> Decision | None:
        now = time.time() if now is None else now
        minute, month = minute_of(now), month_of(now)
        with self._lock:
            c = self._tenants.get(tenant)
            if c is None:
                return None
            prev_requests, prev_tokens, requests, used = _window(c, minute)
            reason = _reason(limits, tokens, now, spent=c.budget.get(month, 0), inflight=len(c.inflight),
                             requests=requests, used=used, prev_requests=prev_requests, prev_used=prev_tokens)
            if reason is None:
                return None
            return decide(reason=reason, reservation=None, limits=limits, now=now, requests=requests,
                          tokens_used=used, prev_requests=prev_requests, prev_tokens=prev_tokens, tokens=tokens)

    async def settle(self, reservation: Reservation, *, used_tokens: int) -> None:
        delta = used_tokens - reservation.tokens
        with self._lock:
            c = self._tenants.get(reservation.tenant)
            if c is None:
                return
            c.inflight.discard(reservation.request_id)
            if c.minute == reservation.minute:
                c.tokens = max(0, c.tokens + delta)
            elif c.minute == reservation.minute + 1:  # its minute is now the window's tail
                c.prev_tokens = max(0, c.prev_tokens + delta)
            c.budget[reservation.month] = max(0, c.budget.get(reservation.month, 0) + delta)

    async def seed_budget(self, *, tenant: str, month: Period, used: int) -> None:
        with self._lock:
            self._tenants.setdefault(tenant, _Counters()).budget.setdefault(month, used)

    async def close(self) -> None:
        return None
