"""The platform's migration and the gateway on a real Postgres: upgrade/downgrade of revision
0002, and a request through the server leaving its usage event (idempotent) in Postgres."""
from __future__ import annotations

import pytest
from sqlalchemy import create_engine, inspect

from adapter_registry.migrate import downgrade, upgrade
from tessera.app import create_app
from tessera.engine_client.inprocess import InProcessEngineClient
from tessera.metering import Usage

from ..adapter_registry.conftest import create_pg_database, drop_pg_database
from .conftest import Platform, ServerThread

BASE = "SmolLM2-135M-Instruct"
PLATFORM_TABLES = {"plans", "tenant_policies", "api_keys", "usage_events"}


@pytest.fixture(scope="module")
def pg_url():
    url = create_pg_database()
    yield url
    drop_pg_database(url)


def test_migration_up_down_up(platform_settings, pg_url):
    settings = platform_settings.model_copy(update={"database_url": pg_url})
    upgrade(settings)
    engine = create_engine(pg_url)
    assert PLATFORM_TABLES <= set(inspect(engine).get_table_names())
    downgrade(settings, "0001")
    assert not PLATFORM_TABLES & set(inspect(engine).get_table_names())
    assert "adapters" in inspect(engine).get_table_names()
    upgrade(settings)
    assert PLATFORM_TABLES <= set(inspect(engine).get_table_names())
    engine.dispose()


def test_gateway_on_postgres_records_usage(platform_settings, pg_url, aengine):
    settings = platform_settings.model_copy(update={"database_url": pg_url})
    upgrade(settings)
    app = create_app(settings, engine_client=InProcessEngineClient(aengine))
    with ServerThread(app) as server:
        p = Platform(server.url, settings, app)
        t = p.tenant(requests_per_minute=10)
        r = p.openai(t).chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=3, temperature=0)
        chunks = list(p.openai(t).chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hi"}],
                                                          max_tokens=3, temperature=0, stream=True))
        assert chunks
        events = {e.request_id: e for e in p.usage_events(t.name)}
        assert len(events) == 2 and events[r.id].completion_tokens == r.usage.completion_tokens
        e = events[r.id]
        dup = Usage(request_id=r.id, tenant_id=e.tenant_id, api_key_id=e.api_key_id, model=BASE, adapter_version=None,
                    priority="standard", prompt_tokens=1, completion_tokens=1, status="completed",
                    finish_reason="stop", ttft_ms=None, duration_ms=1.0)
        assert p.gateway.meter.record_sync(dup) is False
        assert {x.request_id: x for x in p.usage_events(t.name)}[r.id].completion_tokens == r.usage.completion_tokens
        # Usage buckets from Postgres's own time arithmetic: both requests in this hour.
        import time

        start = int(time.time()) // 3600 * 3600 - 3600  # this hour and the one before
        buckets = p.admin.get(f"/admin/v1/tenants/{t.name}/usage/buckets",
                              params={"start_time": start, "end_time": start + 7200, "bucket_width": "1h"})
        assert buckets.status_code == 200, buckets.text
        results = [x for b in buckets.json()["data"] for x in b["results"]]
        assert sum(x["num_model_requests"] for x in results) == 2
        assert sum(x["input_tokens"] for x in results) == sum(x.prompt_tokens for x in events.values())
        # Revocation on Postgres too.
        assert p.admin.delete(f"/admin/v1/tenants/{t.name}/keys/{t.key_id}").status_code == 200
        import openai

        with pytest.raises(openai.AuthenticationError):
            p.openai(t).models.list()
