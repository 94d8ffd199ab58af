"""Quota admission: requests/min, tokens/min, concurrent requests and a monthly token budget.

`reserve` checks every limit and, only if all pass, counts the request in all of them in one
atomic step (a lock in memory.py, one Lua script in redis.py), so no interleaving of concurrent
requests admits a tenant past a limit. A request reserves prompt + max_tokens; `settle` replaces
that with the tokens really used and frees the concurrency slot. The budget is per UTC calendar
month. Minute limits use a sliding window: this UTC minute's count plus the previous minute's,
weighted by the share of it still inside the last 60 seconds (`sliding_estimate`). Fixed
windows would let a tenant send its whole limit at 12:00:59 and again at 12:01:00; here the
second burst waits until the first has slid out. It is exact at minute starts and assumes the
previous minute's requests were spread evenly within it. Months are billing's `Period` (UTC
calendar months; `month_of`), so the budget's month is the one billing invoices.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from tessera.billing.periods import Period


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
    month: Period


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

    async def peek(self, *, tenant: str, limits: Limits, tokens: int, now: float | None = None) -> Decision | None:
        """Read-only: the refusal `reserve` would answer now for a request of at least `tokens`,
        or None. Cheap, so a tenant already over a limit is refused before its request is
        tokenized; `reserve` still decides (atomically) for the requests it lets through."""

    async def settle(self, reservation: Reservation, *, used_tokens: int) -> None:
        """Replace the reserved tokens by `used_tokens` and free the concurrency slot (idempotent
        per reservation is not required: call it exactly once)."""

    async def seed_budget(self, *, tenant: str, month: Period, used: int) -> None:
        """Start the month's budget counter at `used` (from the usage records) unless it already
        exists: counters kept in memory, or in a flushed Redis, must not forget past spending."""

    async def close(self) -> None:
        """Release connections."""


def minute_of(now: float) -> int:
    return int(now // 60)


def month_of(now: float) -> Period:
    """The UTC month of the instant `now` (unix seconds): the budget counter it counts in."""
    return Period.at(now)


def seconds_to_next_minute(now: float) -> float:
    return 60.0 - (now % 60.0)


def seconds_to_next_month(now: float) -> float:
    return max(1.0, month_of(now).seconds_left(now))


def sliding_estimate(prev: float, cur: float, now: float) -> float:
    """Count in the last 60 s: this minute's `cur` plus the previous minute's `prev` weighted by
    the share of that minute still inside the window."""
    return prev * (1.0 - (now % 60.0) / 60.0) + cur


def seconds_until_fits(prev: float, cur: float, need: float, limit: float, now: float) -> float:
    """Seconds from `now` until `need` more fits under `limit` in the sliding window, with no
    new admissions meanwhile (this minute's count becomes the previous one at the next minute)."""
    s = now % 60.0
    room = limit - need - cur
    if room >= 0:
        return 0.0 if prev <= 0 else max(0.0, 60.0 * (1.0 - room / prev) - s)
    room = limit - need
    if room < 0 or cur <= 0:  # too big for any window: the answer is the window's length
        return 60.0 - s
    return (60.0 - s) + max(0.0, 60.0 * (1.0 - room / cur))


def decide(*, reason: str | None, reservation: Reservation | None, limits: Limits, now: float,
           requests: int, tokens_used: int, prev_requests: int = 0, prev_tokens: int = 0,
           tokens: int = 0) -> Decision:
    """Build a Decision from the counters as they stand after the reserve step (shared by
    backends): `requests`/`tokens_used` this minute, `prev_*` the previous minute, `tokens` the
    request's own reservation."""
    rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
    est_requests = sliding_estimate(prev_requests, requests, now)
    est_tokens = sliding_estimate(prev_tokens, tokens_used, now)
    if reason == "requests":
        retry = seconds_until_fits(prev_requests, requests, 1, rpm, now)
    elif reason == "tokens":
        retry = seconds_until_fits(prev_tokens, tokens_used, tokens, tpm, now)
    else:
        retry = {"concurrency": 1.0, "budget": seconds_to_next_month(now)}.get(reason or "", 0.0)
    # Reset: when the window holds nothing of what is counted now (both minutes slid out).
    reset_requests = seconds_to_next_minute(now) + (60.0 if requests else 0.0)
    reset_tokens = seconds_to_next_minute(now) + (60.0 if tokens_used else 0.0)
    return Decision(
        reservation=reservation, reason=reason, limits=limits,
        remaining_requests=None if rpm is None else max(0, rpm - math.ceil(est_requests)),
        remaining_tokens=None if tpm is None else max(0, tpm - math.ceil(est_tokens)),
        reset_requests_s=reset_requests, reset_tokens_s=reset_tokens,
        retry_after_s=float(max(1, math.ceil(retry)) if reason else 0),
    )


def make_quota_backend(redis_url: str | None, *, key_prefix: str = "tessera:quota:") -> QuotaBackend:
    """Redis-backed counters when `redis_url` is set (shared by gateway replicas), else in-process."""
    if redis_url:
        from tessera.quota.redis import RedisQuota

        return RedisQuota(redis_url, key_prefix=key_prefix)
    from tessera.quota.memory import MemoryQuota

    return MemoryQuota()
