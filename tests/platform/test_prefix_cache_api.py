"""Prefix caching through the public API: a tenant's repeated system prompt is served from the
cache (and reported as cached tokens), and another tenant sending the very same prompt never
reads it (the gateway scopes the cache to the tenant)."""
from __future__ import annotations

import uuid

BASE = "SmolLM2-135M-Instruct"


def test_a_tenant_reuses_its_own_prompt_prefix_and_never_another_tenants(platform):
    system = {"role": "system", "content": f"Policy {uuid.uuid4().hex}. " + "Answer briefly and politely. " * 12}
    a, b = platform.tenant(), platform.tenant()
    ca, cb = platform.openai(a), platform.openai(b)

    def ask(client, question):
        return client.chat.completions.create(model=BASE, messages=[system, {"role": "user", "content": question}],
                                              max_tokens=4, temperature=0)

    first = ask(ca, "What is 2 + 2?")
    second = ask(ca, "Name a colour.")
    other = ask(cb, "Name a colour.")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # The shared system prompt's full blocks were reused by the same tenant's next request.
    assert second.usage.prompt_tokens_details.cached_tokens >= 64
    # Another tenant with the same messages computed everything, and got the same answer.
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert other.choices[0].message.content == second.choices[0].message.content
    assert other.usage.prompt_tokens == second.usage.prompt_tokens


def test_operators_can_turn_prefix_caching_off(monkeypatch):
    from engine.sampling_params import GenerationRequest, SamplingParams
    from tessera.engine_client.inprocess import build_inprocess_client
    from tessera.settings import PlatformSettings

    monkeypatch.setenv("TESSERA_ENGINE_PREFIX_CACHING", "false")
    client = build_inprocess_client(PlatformSettings())
    client.aengine.shutdown()  # its step thread stops; the engine is driven directly below
    engine = client.aengine.engine
    assert engine.block_manager.enable_prefix_caching is False
    for i in range(2):  # the same prompt twice: nothing is reused
        out = engine.generate([GenerationRequest(f"r{i}", prompt_token_ids=list(range(100, 200)), cache_salt="t",
                                                 params=SamplingParams(max_tokens=1, temperature=0))])
        assert out[f"r{i}"].cached_tokens == 0
