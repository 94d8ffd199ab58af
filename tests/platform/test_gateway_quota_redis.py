"""The Redis quota backend against the real Redis at 127.0.0.1:6379: the same semantics as the
in-memory one, and the 200-concurrent burst through a gateway that keeps its counters in Redis."""
from __future__ import annotations

import asyncio
import uuid

import pytest
import redis
from tessera.app import create_app
from tessera.engine_client.inprocess import InProcessEngineClient
from tessera.quota.redis import RedisQuota

from tests.requirements import require_redis

from .conftest import Platform, ServerThread
from .test_gateway_quota import avoid_minute_edge, backend_semantics, burst, check_burst

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture(scope="module")
def redis_prefix():
    require_redis()
    prefix = f"tessera-test:{uuid.uuid4().hex[:8]}:"
    yield prefix
    r = redis.Redis.from_url(REDIS_URL)
    for key in r.scan_iter(match=prefix + "*"):
        r.delete(key)


def test_redis_backend_semantics(redis_prefix):
    backend_semantics(lambda: RedisQuota(REDIS_URL, key_prefix=redis_prefix))


def test_200_concurrent_requests_with_redis_counters(platform, aengine, redis_prefix):
    settings = platform.settings.model_copy(update={"redis_url": REDIS_URL, "redis_key_prefix": redis_prefix})
    app = create_app(settings, engine_client=InProcessEngineClient(aengine))
    with ServerThread(app) as server:
        p = Platform(server.url, settings, app)
        n = 4
        t = p.tenant(requests_per_minute=n, tokens_per_minute=1_000_000)
        avoid_minute_edge()
        results = asyncio.run(burst(p.async_openai(t), 200))
        check_burst(p, t, results, n)
        keys = redis.Redis.from_url(REDIS_URL).keys(redis_prefix + "*")
        assert keys  # the counters really live in Redis


def test_revocation_reaches_every_replica_on_the_next_request(platform, aengine, redis_prefix):
    """Two gateways sharing the database and Redis: a key revoked through one is refused by the
    other on its next request, although that one had the caller cached."""
    import openai

    settings = platform.settings.model_copy(update={"redis_url": REDIS_URL, "redis_key_prefix": redis_prefix})
    app_a = create_app(settings, engine_client=InProcessEngineClient(aengine))
    app_b = create_app(settings, engine_client=InProcessEngineClient(aengine))
    with ServerThread(app_a) as a, ServerThread(app_b) as b:
        pa, pb = Platform(a.url, settings, app_a), Platform(b.url, settings, app_b)
        t = pa.tenant()
        for _ in range(2):  # the second call is served from replica B's cache
            assert pb.openai(t).models.list().data
        assert pa.admin.delete(f"/admin/v1/tenants/{t.name}/keys/{t.key_id}").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            pb.openai(t).models.list()
