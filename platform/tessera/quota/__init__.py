"""Quota admission: requests/min, tokens/min, concurrent requests and a monthly token budget.

`reserve` checks every limit and, only if all pass, counts the request in all of them in one
atomic step (a lock in memory.py, one Lua script in redis.py), so no interleaving of concurrent
requests admits a tenant past a limit. A request reserves prompt + max_tokens; `settle` replaces
that with the tokens really used and frees the concurrency slot. Minute limits use fixed windows
(the UTC minute); the budget is per UTC calendar month.
"""
from __future__ import annotations

import calendar
import math
import time
from dataclasses import dataclass
from typing import Protocol


class QuotaUnavailable(RuntimeError):
    """The counters cannot be reached; the gateway refuses with 503 rather than admit unchecked."""


@dataclass(frozen=True)
class Limits:
    """A tenant's effective limits; None means unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    monthly_token_budget: int | None = None


@dataclass(frozen=True)
class Reservation:
    """What one admitted request holds until `settle`."""

    tenant: str
    request_id: str
    tokens: int
    minute: int
    month: str


@dataclass(frozen=True)
class Decision:
    """The answer of `reserve`. `reason` (when refused): requests, tokens, concurrency or budget.
    Remaining counts are after this request (None where unlimited); resets are in seconds."""

    reservation: Reservation | None
    reason: str | None
    limits: Limits
    remaining_requests: int | None
    remaining_tokens: int | None
    reset_requests_s: float
    reset_tokens_s: float
    retry_after_s: float

    @property
    def admitted(self) -> bool:
        return self.reservation is not None


class QuotaBackend(Protocol):
    async def reserve(self, *, tenant: str, request_id: str, limits: Limits, tokens: int,
                      now: float | None = None) -> Decision:
        """Admit and count the request in every limit, or refuse it counting nothing."""

    async def settle(self, reservation: Reservation, *, used_tokens: int) -> None:
        """Replace the reserved tokens by `used_tokens` and free the concurrency slot (idempotent
        per reservation is not required: call it exactly once)."""

    async def seed_budget(self, *, tenant: str, month: str, used: int) -> None:
        """Start the month's budget counter at `used` (from the usage records) unless it already
        exists: counters kept in memory, or in a flushed Redis, must not forget past spending."""

    async def close(self) -> None:
        """Release connections."""


def minute_of(now: float) -> int:
    return int(now // 60)


def month_of(now: float) -> str:
    t = time.gmtime(now)
    return f"{t.tm_year:04d}-{t.tm_mon:02d}"


def seconds_to_next_minute(now: float) -> float:
    return 60.0 - (now % 60.0)


def seconds_to_next_month(now: float) -> float:
    t = time.gmtime(now)
    days = calendar.monthrange(t.tm_year, t.tm_mon)[1]
    end = calendar.timegm((t.tm_year, t.tm_mon, days, 0, 0, 0)) + 86400
    return max(1.0, end - now)


def decide(*, reason: str | None, reservation: Reservation | None, limits: Limits, now: float,
           requests: int, tokens_used: int) -> Decision:
    """Build a Decision from the counters as they stand after the reserve step (shared by backends)."""
    to_minute = seconds_to_next_minute(now)
    retry = {"requests": to_minute, "tokens": to_minute, "concurrency": 1.0,
             "budget": seconds_to_next_month(now)}.get(reason or "", 0.0)
    rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
    return Decision(
        reservation=reservation, reason=reason, limits=limits,
        remaining_requests=None if rpm is None else max(0, rpm - requests),
        remaining_tokens=None if tpm is None else max(0, tpm - tokens_used),
        reset_requests_s=to_minute, reset_tokens_s=to_minute, retry_after_s=float(math.ceil(retry)),
    )


def make_quota_backend(redis_url: str | None, *, key_prefix: str = "tessera:quota:") -> QuotaBackend:
    """Redis-backed counters when `redis_url` is set (shared by gateway replicas), else in-process."""
    if redis_url:
        from tessera.quota.redis import RedisQuota

        return RedisQuota(redis_url, key_prefix=key_prefix)
    from tessera.quota.memory import MemoryQuota

    return MemoryQuota()
