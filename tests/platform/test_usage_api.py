"""GET /v1/usage (the calling tenant) and the admin's per-tenant usage buckets: real requests
land in the right bucket; bucket edges, grouping, pages and bad parameters; tenants never see
each other's usage."""
from __future__ import annotations

import time
from datetime import datetime, timezone

import httpx

from tessera.metering import Usage

BASE = "SmolLM2-135M-Instruct"
HOUR = 3600


def get(platform, key, **params):
    return httpx.get(f"{platform.url}/v1/usage", params=params, headers={"authorization": f"Bearer {key}"}, timeout=60)


def record(platform, tenant, key_id, rid, *, at: int, prompt: int, completion: int, model=BASE, version=None,
           priority="standard", status="completed"):
    """A usage event at unix time `at` (written the way the gateway writes them)."""
    from tessera.models import UsageEvent

    usage = Usage(request_id=rid, tenant_id=tenant_id(platform, tenant), api_key_id=key_id, model=model,
                  adapter_version=version, priority=priority, prompt_tokens=prompt, completion_tokens=completion,
                  status=status, finish_reason="stop", ttft_ms=1.0, duration_ms=2.0)
    assert platform.gateway.meter.record_sync(usage)
    with platform.gateway.session_factory() as s:  # place it in time
        s.get(UsageEvent, rid).created_at = datetime.fromtimestamp(at, timezone.utc)
        s.commit()


def tenant_id(platform, name) -> int:
    return platform.admin.get(f"/admin/v1/tenants/{name}").json()["id"]


def test_a_real_request_shows_in_the_current_bucket(platform):
    t, other = platform.tenant(), platform.tenant()
    before = int(time.time())
    client = platform.openai(t)
    answer = client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "Say hi."}],
                                            max_tokens=3, temperature=0)
    start = before - before % HOUR  # the request's hour (or the next one, at an hour boundary)
    r = get(platform, t.key, start_time=start, end_time=start + 2 * HOUR, bucket_width="1h")
    assert r.status_code == 200, r.text
    page = r.json()
    assert page["object"] == "page" and not page["has_more"]
    assert [(b["start_time"], b["end_time"]) for b in page["data"]] == [(start, start + HOUR), (start + HOUR, start + 2 * HOUR)]
    [res] = [x for b in page["data"] for x in b["results"]]
    assert res["input_tokens"] == answer.usage.prompt_tokens
    assert res["output_tokens"] == answer.usage.completion_tokens
    assert res["num_model_requests"] == 1
    # The other tenant sees none of it; the admin sees the same as the tenant.
    theirs = get(platform, other.key, start_time=start, end_time=start + 2 * HOUR, bucket_width="1h").json()
    assert all(b["results"] == [] for b in theirs["data"])
    admin = platform.admin.get(f"/admin/v1/tenants/{t.name}/usage/buckets",
                               params={"start_time": start, "end_time": start + 2 * HOUR, "bucket_width": "1h"})
    assert admin.status_code == 200 and admin.json() == page


def test_bucket_edges_grouping_and_pages(platform):
    t = platform.tenant()
    day0 = 1_700_000_000 - 1_700_000_000 % 86400  # a past midnight UTC
    record(platform, t.name, t.key_id, f"{t.name}-a", at=day0, prompt=10, completion=5)  # first second: bucket 0
    record(platform, t.name, t.key_id, f"{t.name}-b", at=day0 + HOUR - 1, prompt=7, completion=1,
           model="pirate@abc", version="abc" * 20, priority="batch")
    record(platform, t.name, t.key_id, f"{t.name}-c", at=day0 + HOUR, prompt=3, completion=2,  # next bucket
           model="pirate", version="def" * 20, status="aborted")
    record(platform, t.name, t.key_id, f"{t.name}-d", at=day0 + 5 * HOUR, prompt=1, completion=1)  # past the end

    r = get(platform, t.key, start_time=day0, end_time=day0 + 2 * HOUR, bucket_width="1h", group_by="adapter")
    data = r.json()["data"]
    assert [b["start_time"] for b in data] == [day0, day0 + HOUR]
    first = {x["adapter"]: (x["input_tokens"], x["output_tokens"], x["num_model_requests"]) for x in data[0]["results"]}
    assert first == {None: (10, 5, 1), "pirate": (7, 1, 1)}
    # "pirate" and "pirate@abc" are one series, whatever version served them; aborted usage counts.
    assert [(x["adapter"], x["input_tokens"]) for x in data[1]["results"]] == [("pirate", 3)]

    by_prio = get(platform, t.key, start_time=day0, end_time=day0 + HOUR, bucket_width="1h",
                  group_by=["priority", "api_key"]).json()["data"][0]["results"]
    assert sorted((x["priority"], x["api_key_id"], x["input_tokens"]) for x in by_prio) == [
        ("batch", t.key_id, 7), ("standard", t.key_id, 10)]

    # Day buckets, one per page: the second page holds nothing, the first everything of that day.
    p1 = get(platform, t.key, start_time=day0, end_time=day0 + 2 * 86400, bucket_width="1d", limit=1).json()
    assert p1["has_more"] and len(p1["data"]) == 1
    assert sum(x["input_tokens"] for x in p1["data"][0]["results"]) == 21
    p2 = get(platform, t.key, start_time=day0, end_time=day0 + 2 * 86400, bucket_width="1d", limit=1,
             page=p1["next_page"]).json()
    assert not p2["has_more"] and p2["next_page"] is None and p2["data"][0]["results"] == []


def test_requests_end_users_are_recorded_and_reported_per_end_user(platform):
    t = platform.tenant()
    before = int(time.time())
    client = platform.openai(t)
    for user in ("alice", "alice", "bob", None):
        client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "Say hi."}], max_tokens=2,
                                       temperature=0, user=user, safety_identifier=user and f"hash-{user}")
    events = platform.usage_events(t.name)
    assert sorted((e.end_user or "", e.safety_identifier or "") for e in events) == [
        ("", ""), ("alice", "hash-alice"), ("alice", "hash-alice"), ("bob", "hash-bob")]
    start = before - before % HOUR
    data = get(platform, t.key, start_time=start, end_time=start + 2 * HOUR, bucket_width="1h",
               group_by="end_user").json()["data"]
    counts = {x["end_user"]: x["num_model_requests"] for b in data for x in b["results"]}
    assert counts == {"alice": 2, "bob": 1, None: 1}


def test_bad_parameters_are_400s_naming_them(platform):
    t = platform.tenant()
    for params, param in (({}, "start_time"), ({"start_time": 0, "bucket_width": "1w"}, "bucket_width"),
                          ({"start_time": 0, "group_by": "model"}, "group_by"),
                          ({"start_time": 100, "end_time": 100}, "end_time"),
                          ({"start_time": 0, "limit": 0}, "limit"), ({"start_time": 0, "page": "x"}, "page")):
        r = get(platform, t.key, **params)
        assert r.status_code == 400, (params, r.text)
        assert r.json()["error"]["param"] == param
    assert platform.admin.get("/admin/v1/tenants/nobody-here/usage/buckets", params={"start_time": 0}).status_code == 404
    assert httpx.get(f"{platform.url}/v1/usage", params={"start_time": 0}).status_code == 401
