"""A configuration epoch: a counter the admin API bumps after every change to keys, tenants,
plans or quotas. Gateways cache authenticated callers tagged with the epoch they were read at
and drop the cache when the epoch moves, so a revoked key is refused on the very next request
while an unchanged key costs no database query.

In memory for the embedded mode (one gateway process); in Redis when configured, shared by every
gateway replica (one GET per request). Changes made behind the admin API's back (by hand in the
database) are seen after `max_age_s` at the latest.
"""
from __future__ import annotations

import time
from typing import Generic, Protocol, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError

V = TypeVar("V")


class Epoch(Protocol):
    async def current(self) -> int | None:
        """The epoch now; None when it cannot be read (callers then skip the cache)."""

    async def bump(self) -> None:
        """Invalidate every gateway's caches."""

    async def close(self) -> None: ...


class MemoryEpoch:
    def __init__(self) -> None:
        self.value = 0

    async def current(self) -> int | None:
        return self.value

    async def bump(self) -> None:
        self.value += 1

    async def close(self) -> None:
        return None


class RedisEpoch:
    def __init__(self, url: str, *, key: str = "tessera:config-epoch"):
        self.client = aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(
            url, max_connections=32, timeout=5))
        self.key = key

    async def current(self) -> int | None:
        try:
            return int(await self.client.get(self.key) or 0)
        except RedisError:
            return None

    async def bump(self) -> None:
        await self.client.incr(self.key)

    async def close(self) -> None:
        await self.client.aclose()


class EpochCache(Generic[V]):
    """A dict whose entries are valid only at the epoch they were stored at (and for max_age_s)."""

    def __init__(self, *, max_entries: int = 100_000, max_age_s: float = 60.0):
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        self._items: dict[str, tuple[int, float, V]] = {}

    def get(self, key: str, epoch: int | None) -> V | None:
        item = self._items.get(key)
        if item is None or epoch is None or item[0] != epoch or time.monotonic() - item[1] > self.max_age_s:
            return None
        return item[2]

    def put(self, key: str, epoch: int | None, value: V) -> None:
        if epoch is None:
            return
        if len(self._items) >= self.max_entries:
            self._items.clear()  # crude but bounded; refills from the database
        self._items[key] = (epoch, time.monotonic(), value)


def make_epoch(redis_url: str | None, *, key_prefix: str = "tessera:") -> Epoch:
    return RedisEpoch(redis_url, key=f"{key_prefix}config-epoch") if redis_url else MemoryEpoch()
