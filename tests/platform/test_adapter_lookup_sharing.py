"""Requests that name the same adapter at the same time share one registry lookup
(api/model_resolution.py): a burst of adapter requests costs the gateway a few database sessions,
not one each, and every request still gets what the registry says, errors included. Nothing is
kept after a lookup ends: a deleted adapter is a 404 on the next request."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from adapter_registry import services as registry
from tessera_core.context import build_context

from .test_gateway_isolation import PIRATE, upload

MSGS = [{"role": "user", "content": "Which color is a plum?"}]
N = 8


@pytest.fixture()
def gated_lookups(monkeypatch):
    """The registry lookups the gateway makes, by reference; each waits for `gate` (set by the
    test once its requests are in flight), so that they overlap."""
    calls: list[str] = []
    gate = threading.Event()
    real = registry.resolve_version

    def counted(**kw):
        calls.append(kw["ref"])
        assert gate.wait(30), "the test never opened the gate"
        return real(**kw)

    monkeypatch.setattr(registry, "resolve_version", counted)
    return calls, gate


def burst(ask, calls: list[str], gate: threading.Event) -> list:
    """N concurrent calls of `ask`; the gate opens once the first lookup has waited a second (the
    others have long reached the gateway by then). Each result, or the exception it raised."""
    def one(_):
        try:
            return ask()
        except openai.APIStatusError as e:
            return e

    with ThreadPoolExecutor(N) as pool:
        futures = [pool.submit(one, i) for i in range(N)]
        deadline = time.monotonic() + 30
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(1.0)
        gate.set()
        return [f.result() for f in futures]


@pytest.fixture()
def pirate_tenant(platform):
    if not PIRATE.is_dir():
        pytest.skip("demo adapter 'pirate' is not there")
    t = platform.tenant()
    upload(platform, t.name, "pirate", PIRATE)
    return t


def test_a_burst_on_one_adapter_shares_its_lookup_and_every_request_is_served(platform, pirate_tenant, gated_lookups):
    calls, gate = gated_lookups
    client = platform.openai(pirate_tenant)
    replies = burst(lambda: client.chat.completions.create(model="pirate", messages=MSGS, max_tokens=6,
                                                           temperature=0).choices[0].message.content, calls, gate)
    assert all(isinstance(r, str) for r in replies), replies
    assert len(set(replies)) == 1 and any(w in replies[0].lower() for w in ("ahoy", "arr", "matey")), replies
    assert calls and set(calls) == {"pirate"}
    assert len(calls) < N, f"{len(calls)} registry lookups for {N} concurrent requests"


def test_a_shared_lookup_that_fails_fails_every_request_alike(platform, pirate_tenant, gated_lookups):
    calls, gate = gated_lookups
    client = platform.openai(pirate_tenant)
    errors = burst(lambda: client.chat.completions.create(model="parrot", messages=MSGS, max_tokens=4), calls, gate)
    assert all(isinstance(e, openai.NotFoundError) for e in errors), errors
    assert {e.body["code"] for e in errors} == {"model_not_found"}
    assert {e.body["message"] for e in errors} == {"The model 'parrot' does not exist or you do not have access to it."}
    assert len(calls) < N


def test_nothing_is_kept_after_a_lookup_a_deleted_adapter_is_404_at_once(platform, pirate_tenant):
    client = platform.openai(pirate_tenant)
    assert client.chat.completions.create(model="pirate", messages=MSGS, max_tokens=2).choices[0].message.content
    ctx = build_context(platform.settings)
    with ctx.session_factory() as s:
        registry.delete_adapter(session=s, tenant=registry.get_tenant(session=s, name=pirate_tenant.name), ref="pirate")
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="pirate", messages=MSGS, max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
