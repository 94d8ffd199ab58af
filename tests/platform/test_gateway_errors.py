"""Clear 4xx errors in OpenAI's shape, and the server keeps serving after each."""
from __future__ import annotations

import httpx
import openai
import pytest

BASE = "SmolLM2-135M-Instruct"
CHAT = {"model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}


def post(platform, key, *, json=None, content=None, path="/v1/chat/completions", headers=None):
    h = {"authorization": f"Bearer {key}"} | (headers or {})
    return httpx.post(f"{platform.url}{path}", json=json, content=content, headers=h, timeout=60)


def assert_error(r, status, code=None, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param
    return err


def still_serving(platform, key):
    r = post(platform, key, json=CHAT)
    assert r.status_code == 200, r.text


def test_bad_json(platform):
    t = platform.tenant()
    err = assert_error(post(platform, t.key, content=b'{"model": "x", "messages": [', headers={"content-type": "application/json"}),
                       400, "invalid_json")
    assert "JSON" in err["message"]
    still_serving(platform, t.key)


def test_schema_errors_name_the_field(platform):
    t = platform.tenant()
    assert_error(post(platform, t.key, json={"model": BASE}), 400, param="messages")
    assert_error(post(platform, t.key, json=CHAT | {"max_tokens": "many"}), 400, param="max_tokens")
    assert_error(post(platform, t.key, json=CHAT | {"temprature": 0.5}), 400, param="temprature")
    assert_error(post(platform, t.key, json=CHAT | {"n": 17}), 400, param="n")
    assert_error(post(platform, t.key, json=CHAT | {"messages": []}), 400, param="messages")
    still_serving(platform, t.key)


def test_unknown_model(platform):
    t = platform.tenant()
    with pytest.raises(openai.NotFoundError) as e:
        platform.openai(t).chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found" and "gpt-17" in e.value.body["message"]
    still_serving(platform, t.key)


def test_max_tokens_beyond_the_context(platform):
    t = platform.tenant()
    ctx = platform.gateway.engine.max_model_len
    with pytest.raises(openai.BadRequestError) as e:
        platform.openai(t).chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=ctx)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "max_tokens"
    assert str(ctx) in e.value.body["message"]
    # Not billed, not counted against quotas.
    assert platform.usage_events(t.name) == []
    still_serving(platform, t.key)


def test_oversized_body(platform):
    t = platform.tenant()
    big = "word " * (platform.settings.max_body_bytes // 4)
    err = assert_error(post(platform, t.key, json=CHAT | {"messages": [{"role": "user", "content": big}]}),
                       413, "request_too_large")
    assert str(platform.settings.max_body_bytes) in err["message"]

    def chunks():  # no Content-Length: the limit applies while reading
        for _ in range(8):
            yield b" " * (platform.settings.max_body_bytes // 4)

    assert_error(post(platform, t.key, content=chunks(), headers={"content-type": "application/json"}), 413)
    still_serving(platform, t.key)


def test_missing_and_invalid_keys(platform):
    t = platform.tenant()
    r = httpx.post(f"{platform.url}/v1/chat/completions", json=CHAT)
    assert_error(r, 401, "missing_api_key")
    assert_error(post(platform, "tsk-" + "A" * 12 + "." + "B" * 43, json=CHAT), 401, "invalid_api_key")
    # Right prefix, wrong secret.
    forged = t.key[: t.key.index(".") + 1] + "C" * 43
    assert_error(post(platform, forged, json=CHAT), 401, "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        platform.openai(t.__class__(t.name, "garbage", 0)).models.list()
    still_serving(platform, t.key)


def test_revoked_key_is_refused_on_the_next_request(platform):
    t = platform.tenant()
    r = platform.admin.post(f"/admin/v1/tenants/{t.name}/keys", json={"name": "second"})
    second = r.json()["key"]
    client = platform.openai(t)
    assert client.models.list().data
    r = platform.admin.delete(f"/admin/v1/tenants/{t.name}/keys/{t.key_id}")
    assert r.status_code == 200 and r.json()["revoked_at"]
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    still_serving(platform, second)


def test_keys_are_shown_once_and_stored_as_hashes(platform):
    from sqlalchemy import select

    from tessera.models import ApiKey

    t = platform.tenant()
    secret = t.key.split(".", 1)[1]
    assert len(secret) >= 43  # 32 random bytes, base64url
    with platform.gateway.session_factory() as s:
        row = s.scalar(select(ApiKey).where(ApiKey.id == t.key_id))
    assert secret not in (row.key_hash + row.prefix) and len(row.key_hash) == 64


def test_unknown_route_and_empty_prompt(platform):
    t = platform.tenant(max_concurrent_requests=1)
    assert_error(httpx.get(f"{platform.url}/v1/nothing", headers={"authorization": f"Bearer {t.key}"}), 404)
    assert_error(post(platform, t.key, path="/v1/completions", json={"model": BASE, "prompt": "", "max_tokens": 2}),
                 400, param="prompt")
    still_serving(platform, t.key)  # the refused request's concurrency slot was released
    # A caller's mistake is neither billed nor recorded as a server error (availability SLOs).
    assert [e.status for e in platform.usage_events(t.name)] == ["completed"]
