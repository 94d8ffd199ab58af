"""In-process quota counters (embedded mode: one gateway process). A lock makes check-and-count
one step even when called from several threads."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from tessera.quota import Decision, Limits, Reservation, decide, minute_of, month_of, sliding_estimate


@dataclass
class _Counters:
    minute: int = -1
    requests: int = 0
    tokens: int = 0
    prev_requests: int = 0  # the previous minute's counts (the sliding window's tail)
    prev_tokens: int = 0
    inflight: set[str] = field(default_factory=set)
    budget: dict[str, int] = field(default_factory=dict)  # month -> tokens reserved or used


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
                if c.minute == minute - 1:
                    c.prev_requests, c.prev_tokens = c.requests, c.tokens
                else:
                    c.prev_requests = c.prev_tokens = 0
                c.minute, c.requests, c.tokens = minute, 0, 0
            spent = c.budget.get(month, 0)
            reason = None
            if limits.monthly_token_budget is not None and spent + tokens > limits.monthly_token_budget:
                reason = "budget"
            elif limits.max_concurrent_requests is not None and len(c.inflight) + 1 > limits.max_concurrent_requests:
                reason = "concurrency"
            elif (limits.requests_per_minute is not None
                  and sliding_estimate(c.prev_requests, c.requests, now) + 1 > limits.requests_per_minute):
                reason = "requests"
            elif (limits.tokens_per_minute is not None
                  and sliding_estimate(c.prev_tokens, c.tokens, now) + tokens > limits.tokens_per_minute):
                reason = "tokens"
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

    async def seed_budget(self, *, tenant: str, month: str, used: int) -> None:
        with self._lock:
            self._tenants.setdefault(tenant, _Counters()).budget.setdefault(month, used)

    async def close(self) -> None:
        return None
