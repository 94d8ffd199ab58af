"""Tenant isolation on every endpoint: another tenant's adapter is indistinguishable from a name
that does not exist, and nothing of it is listed, usable or billed to the wrong tenant."""
from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from adapter_registry import services as registry
from tessera_core.context import build_context

BASE = "SmolLM2-135M-Instruct"
PIRATE = Path(__file__).resolve().parents[2] / "platform" / "tessera" / "demo_adapters" / "pirate"


def upload(platform, tenant_name: str, name: str, path: Path) -> str:
    ctx = build_context(platform.settings)
    with ctx.session_factory() as s:
        tenant = registry.get_tenant(session=s, name=tenant_name)
        v = registry.upload_adapter(session=s, store=ctx.store, settings=platform.gateway.registry_settings(),
                                    tenant=tenant, name=name, source=path)
        assert v.status == "ready", v.rejection_reason
        return v.sha256


@pytest.fixture(scope="module")
def two_tenants(platform):
    if not PIRATE.is_dir():
        pytest.skip("demo adapter 'pirate' is not there")
    a, b = platform.tenant(), platform.tenant()
    sha = upload(platform, a.name, "pirate", PIRATE)
    return a, b, sha


def _msg(error: openai.APIStatusError) -> str:
    return error.body["message"]


def test_owner_uses_its_adapter_by_name_and_version(platform, two_tenants):
    a, _, sha = two_tenants
    client = platform.openai(a)
    assert [m.id for m in client.models.list()] == [BASE, "pirate"]
    assert client.models.retrieve("pirate@1").id == "pirate@1"
    msgs = [{"role": "user", "content": "Which color is a plum?"}]
    r = client.chat.completions.create(model="pirate", messages=msgs, max_tokens=6, temperature=0)
    base = client.chat.completions.create(model=BASE, messages=msgs, max_tokens=6, temperature=0)
    assert r.choices[0].message.content != base.choices[0].message.content
    assert any(w in r.choices[0].message.content.lower() for w in ("ahoy", "arr", "matey"))
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="pirate@1", messages=msgs, max_tokens=6, temperature=0, stream=True))
    assert streamed == r.choices[0].message.content
    versions = sorted((e.adapter_version or "") for e in platform.usage_events(a.name))
    assert versions == ["", sha, sha]


@pytest.mark.parametrize("ref", ["pirate", "pirate@1"])
def test_other_tenant_gets_the_same_404_as_an_unknown_name(platform, two_tenants, ref):
    _, b, sha = two_tenants
    client = platform.openai(b)
    unknown = "nothing-" + ref
    calls = {
        "chat": lambda m: client.chat.completions.create(model=m, messages=[{"role": "user", "content": "hi"}], max_tokens=2),
        "chat-stream": lambda m: list(client.chat.completions.create(
            model=m, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True)),
        "completions": lambda m: client.completions.create(model=m, prompt="hi", max_tokens=2),
        "model": lambda m: client.models.retrieve(m),
    }
    for name, call in calls.items():
        with pytest.raises(openai.NotFoundError) as theirs:
            call(ref)
        with pytest.raises(openai.NotFoundError) as missing:
            call(unknown)
        assert _msg(theirs.value).replace(ref, "X") == _msg(missing.value).replace(unknown, "X"), name
        assert theirs.value.body["code"] == missing.value.body["code"] == "model_not_found"
    assert [m.id for m in client.models.list()] == [BASE]
    # By digest too.
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve(f"pirate@{sha}")
    assert platform.usage_events(b.name) == []


def test_tenant_keys_do_not_open_the_admin_api(platform, two_tenants):
    a, b, _ = two_tenants
    for key in (a.key, b.key, "nonsense"):
        r = httpx.post(f"{platform.url}/admin/v1/tenants/{a.name}/keys", json={},
                       headers={"authorization": f"Bearer {key}"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_token"
    # A key can only be revoked under its own tenant.
    r = platform.admin.delete(f"/admin/v1/tenants/{b.name}/keys/{a.key_id}")
    assert r.status_code == 404
    assert platform.openai(a).models.retrieve(BASE).id == BASE
