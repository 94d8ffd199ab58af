"""Redis quota counters, shared by every gateway replica. Check-and-count is one Lua script, which
Redis runs atomically. Keys per tenant (one hash slot through the {tenant} tag):
  req:{t}:<minute>, tok:{t}:<minute>  per-minute counters, expire after 3 minutes; the limit is
                                      checked against this minute's count plus the previous
                                      minute's, weighted (a sliding window: quota/__init__.py)
  conc:{t}                            sorted set request_id -> lease deadline (a crashed gateway's
                                      slots expire after `lease_s` instead of leaking forever)
  budget:{t}:<YYYY-MM>                tokens reserved or used this month (Period.name), kept 40 days
"""
from __future__ import annotations

import time

import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from tessera.billing.periods import Period
from tessera.quota import Decision, Limits, QuotaUnavailable, Reservation, decide, minute_of, month_of

log = logging.getLogger(__name__)

_RESERVE = """
local now = tonumber(ARGV[1])
local rid = ARGV[2]
local tokens = tonumber(ARGV[3])
local rpm, tpm, conc, budget = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local lease = tonumber(ARGV[8])
local w = tonumber(ARGV[9])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local reqs = tonumber(redis.call('GET', KEYS[1]) or '0')
local used = tonumber(redis.call('GET', KEYS[2]) or '0')
local preqs = tonumber(redis.call('GET', KEYS[5]) or '0')
local pused = tonumber(redis.call('GET', KEYS[6]) or '0')
local inflight = redis.call('ZCARD', KEYS[3])
local spent = tonumber(redis.call('GET', KEYS[4]) or '0')
if budget >= 0 and spent + tokens > budget then return {0, 'budget', reqs, used, preqs, pused} end
if conc >= 0 and inflight + 1 > conc then return {0, 'concurrency', reqs, used, preqs, pused} end
if rpm >= 0 and preqs * w + reqs + 1 > rpm then return {0, 'requests', reqs, used, preqs, pused} end
if tpm >= 0 and pused * w + used + tokens > tpm then return {0, 'tokens', reqs, used, preqs, pused} end
redis.call('INCR', KEYS[1]); redis.call('EXPIRE', KEYS[1], 180)
redis.call('INCRBY', KEYS[2], tokens); redis.call('EXPIRE', KEYS[2], 180)
redis.call('ZADD', KEYS[3], now + lease, rid); redis.call('EXPIRE', KEYS[3], lease)
redis.call('INCRBY', KEYS[4], tokens); redis.call('EXPIRE', KEYS[4], 3456000)
return {1, 'ok', reqs + 1, used + tokens, preqs, pused}
"""

# The checks of _RESERVE without its writes: live leases counted, expired ones left for the next
# reserve to remove.
_PEEK = """
local now = tonumber(ARGV[1])
local tokens = tonumber(ARGV[2])
local rpm, tpm, conc, budget = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local w = tonumber(ARGV[7])
local reqs = tonumber(redis.call('GET', KEYS[1]) or '0')
local used = tonumber(redis.call('GET', KEYS[2]) or '0')
local preqs = tonumber(redis.call('GET', KEYS[5]) or '0')
local pused = tonumber(redis.call('GET', KEYS[6]) or '0')
local inflight = redis.call('ZCOUNT', KEYS[3], '(' .. ARGV[1], '+inf')
local spent = tonumber(redis.call('GET', KEYS[4]) or '0')
if budget >= 0 and spent + tokens > budget then return {0, 'budget', reqs, used, preqs, pused} end
if conc >= 0 and inflight + 1 > conc then return {0, 'concurrency', reqs, used, preqs, pused} end
if rpm >= 0 and preqs * w + reqs + 1 > rpm then return {0, 'requests', reqs, used, preqs, pused} end
if tpm >= 0 and pused * w + used + tokens > tpm then return {0, 'tokens', reqs, used, preqs, pused} end
return {1, 'ok', reqs, used, preqs, pused}
"""

_SETTLE = """
local delta = tonumber(ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[2])
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('INCRBY', KEYS[2], delta) end
if redis.call('EXISTS', KEYS[4]) == 1 then redis.call('INCRBY', KEYS[4], delta) end
return 1
"""


def _lim(v: int | None) -> int:
    return -1 if v is None else int(v)


class RedisQuota:
    """QuotaBackend over Redis (see module docstring)."""

    def __init__(self, url: str, *, key_prefix: str = "tessera:quota:", lease_s: int = 900,
                 max_connections: int = 64):
        # A blocking pool: a burst waits for a free connection instead of failing.
        self.client = aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=5))
        self.prefix = key_prefix
        self.lease_s = lease_s
        self._reserve = self.client.register_script(_RESERVE)
        self._settle = self.client.register_script(_SETTLE)
        self._peek = self.client.register_script(_PEEK)

    def _keys(self, tenant: str, minute: int, month: Period) -> list[str]:
        t, p = "{" + tenant + "}", self.prefix
        return [f"{p}req:{t}:{minute}", f"{p}tok:{t}:{minute}", f"{p}conc:{t}", f"{p}budget:{t}:{month.name}",
                f"{p}req:{t}:{minute - 1}", f"{p}tok:{t}:{minute - 1}"]

    async def reserve(self, *, tenant: str, request_id: str, limits: Limits, tokens: int,
                      now: float | None = None) -> Decision:
        now = time.time() if now is None else now
        minute, month = minute_of(now), month_of(now)
        try:
            ok, reason, reqs, used, preqs, pused = await self._reserve(
                keys=self._keys(tenant, minute, month),
                args=[repr(now), request_id, tokens, _lim(limits.requests_per_minute), _lim(limits.tokens_per_minute),
                      _lim(limits.max_concurrent_requests), _lim(limits.monthly_token_budget), self.lease_s,
                      repr(1.0 - (now % 60.0) / 60.0)])
        except RedisError as e:
            raise QuotaUnavailable(f"quota counters unavailable ({type(e).__name__})") from e
        reservation = Reservation(tenant, request_id, tokens, minute, month) if ok == 1 else None
        reason = None if ok == 1 else (reason.decode() if isinstance(reason, bytes) else reason)
        return decide(reason=reason, reservation=reservation, limits=limits, now=now,
                      requests=int(reqs), tokens_used=int(used), prev_requests=int(preqs), prev_tokens=int(pused),
                      tokens=tokens)

    async def peek(self, *, tenant: str, limits: Limits, tokens: int, now: float | None = None) -> Decision | None:
        now = time.time() if now is None else now
        minute, month = minute_of(now), month_of(now)
        try:
            ok, reason, reqs, used, preqs, pused = await self._peek(
                keys=self._keys(tenant, minute, month),
                args=[repr(now), tokens, _lim(limits.requests_per_minute), _lim(limits.tokens_per_minute),
                      _lim(limits.max_concurrent_requests), _lim(limits.monthly_token_budget),
                      repr(1.0 - (now % 60.0) / 60.0)])
        except RedisError as e:
            raise QuotaUnavailable(f"quota counters unavailable ({type(e).__name__})") from e
        if ok == 1:
            return None
        return decide(reason=reason.decode() if isinstance(reason, bytes) else reason, reservation=None,
                      limits=limits, now=now, requests=int(reqs), tokens_used=int(used), prev_requests=int(preqs),
                      prev_tokens=int(pused), tokens=tokens)

    async def settle(self, reservation: Reservation, *, used_tokens: int) -> None:
        try:
            await self._settle(keys=self._keys(reservation.tenant, reservation.minute, reservation.month),
                               args=[used_tokens - reservation.tokens, reservation.request_id])
        except RedisError:
            # The reservation stays counted (the tenant is over- not under-charged) and its
            # concurrency slot expires with the lease.
            log.exception("could not settle quota for request %s", reservation.request_id)

    async def seed_budget(self, *, tenant: str, month: Period, used: int) -> None:
        try:
            await self.client.set(self._keys(tenant, 0, month)[3], used, nx=True, ex=3456000)
        except RedisError as e:
            raise QuotaUnavailable(f"quota counters unavailable ({type(e).__name__})") from e

    async def close(self) -> None:
        await self.client.aclose()
