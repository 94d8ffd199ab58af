"""Schemathesis over the platform's own OpenAPI schema: every tenant and admin operation, with
generated (valid and invalid) parameters and bodies, must answer without a 5xx and without a hang,
and with a body the document declares for its status code and content type (the response models
of api/response_models.py for 2xx, OpenAI's error shape for 4xx): the document is the contract.
The bodies' strings are often Unicode-heavy text (`flatmap_body`): lone surrogates (sent as
\\uXXXX escapes, valid JSON), combining marks, joiners, bidi controls, astral characters, NUL.

The gateway runs on its own database beside the session's engine; requests carry a tenant key
(tenant routes) or the admin token (admin routes). The tenant's plan bounds what generated
completions may cost (tokens per minute), as it would for a hostile tenant: requests reserving
more are refused with a 429 before reaching the engine.
"""
from __future__ import annotations

import json
import os
import zlib

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis.checks import content_type_conformance, response_schema_conformance

from adapter_registry.migrate import upgrade
from tessera.app import create_app
from tessera.engine_client.inprocess import InProcessEngineClient
from tessera.settings import PlatformSettings

from .conftest import ADMIN_TOKEN, ServerThread

# Enough examples per operation to reach the refusal paths of every field, few enough that the
# whole run stays around a minute on two cores (FUZZ_EXAMPLES=500 for a longer hunt).
EXAMPLES_PER_OPERATION = int(os.environ.get("FUZZ_EXAMPLES", "40"))
REQUEST_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory, aengine):
    root = tmp_path_factory.mktemp("fuzz")
    settings = PlatformSettings(
        _env_file=None, database_url=f"sqlite:///{root}/tessera.db", object_store_root=root / "objects",
        adapter_cache_dir=root / "adapter-cache", usage_outbox_dir=root / "outbox", admin_token=ADMIN_TOKEN,
        # The generated sign-ins (wrong passwords) come from the address the admin calls use: no
        # delay, no lockout, or the admin operations would be fuzzed against 429s only.
        admin_login_delay_s=0.0, admin_max_failures_per_minute=10**6,
        max_body_bytes=64 * 1024, max_upload_bytes=1 << 20)
    upgrade(settings)
    app = create_app(settings, engine_client=InProcessEngineClient(aengine))
    with ServerThread(app) as server:
        admin = httpx.Client(base_url=server.url, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=60)
        assert admin.put("/admin/v1/plans/fuzz", json={"requests_per_minute": 600, "tokens_per_minute": 600,
                                                       "max_concurrent_requests": 4}).status_code == 200
        assert admin.post("/admin/v1/tenants", json={"name": "fuzz", "plan": "fuzz"}).status_code == 201
        key = admin.post("/admin/v1/tenants/fuzz/keys", json={"name": "fuzz"}).json()["key"]
        yield server.url, key, admin


# The schema the app publishes at /openapi.json, read from an app built with throwaway settings
# (the document does not depend on them), so each operation is its own test.
schema = schemathesis.openapi.from_dict(
    create_app(PlatformSettings(_env_file=None, admin_token=ADMIN_TOKEN)).openapi())
BASE_MODEL = "SmolLM2-135M-Instruct"


@schema.hook
def map_body(context, body):
    """Completions name the served base model half of the time, so the generated sampling
    parameters, stops, seeds and prompts reach the engine instead of stopping at a 404."""
    path = context.operation.path if context.operation is not None else ""
    if path.endswith("completions") and isinstance(body, dict) and zlib.crc32(repr(body).encode()) % 2 == 0:
        body["model"] = BASE_MODEL
    return body


# Characters drawn one by one from any code point (lone surrogates included), a few that break
# naive text handling, and the surrogate range itself.
_ODD = "\u0301\u200d\u202e\ufeff\U0001F600\u0661\u00b2\x00\ud800\udfff"
UNICODE_TEXT = st.lists(st.one_of(st.characters(exclude_categories=()), st.sampled_from(_ODD),
                                  st.integers(0xD800, 0xDFFF).map(chr)), max_size=32).map("".join)
#: The same without lone surrogates, for bodies that are not JSON (a multipart form cannot carry them).
ENCODABLE_TEXT = UNICODE_TEXT.map(lambda t: "".join(c for c in t if not 0xD800 <= ord(c) <= 0xDFFF))


def _string_spots(value, path=()):
    """The paths of every string value in a JSON value."""
    if isinstance(value, str):
        yield path
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _string_spots(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _string_spots(v, path + (i,))


def _with_texts(body, spots, texts):
    if () in spots:  # the body is itself a string
        return texts[0] if texts[0] is not None else body
    body = json.loads(json.dumps(body))
    for path, text in zip(spots, texts):
        if text is not None:
            parent = body
            for k in path[:-1]:
                parent = parent[k]
            parent[path[-1]] = text
    return body


@schema.hook
def flatmap_body(context, body):
    """Each string of the generated body is kept, or (one time in three) replaced by
    Unicode-heavy text; a completion's `model` is kept, so that `map_body`'s base model still
    takes half of them to the engine."""
    spots = [p for p in _string_spots(body) if p != ("model",)]
    if not spots:
        return st.just(body)
    operation = context.operation
    json_body = operation is None or any("json" in b.media_type for b in operation.body)
    pick = st.one_of(st.none(), st.none(), UNICODE_TEXT if json_body else ENCODABLE_TEXT)
    return st.tuples(*(pick for _ in spots)).map(lambda texts: _with_texts(body, spots, texts))


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_every_operation_answers_its_declared_schema_without_5xx_or_hang(case, fuzzed):
    url, key, _ = fuzzed
    path = case.path
    if path.startswith("/admin/session"):
        headers = {}
    elif path.startswith("/admin"):
        headers = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    else:
        headers = {"authorization": f"Bearer {key}"}
    response = case.call(base_url=url, headers=headers, timeout=REQUEST_TIMEOUT_S)
    assert response.status_code < 500, (
        f"{case.method} {case.formatted_path} answered {response.status_code}: {response.text[:500]}\n"
        f"reproduce: {case.as_curl_command(headers=headers)}")
    # The body (JSON, or SSE for a stream) is what the document declares for this status.
    case.validate_response(response, checks=[response_schema_conformance, content_type_conformance],
                           headers=headers)


def test_the_gateway_still_serves_after_the_fuzzing(fuzzed, aengine):
    url, key, admin = fuzzed
    # The generated completions did reach the engine (not all stopped at validation or a 404).
    r = admin.get("/admin/v1/tenants/fuzz/usage")
    assert r.status_code == 200, r.text
    served = r.json()["by_status"]
    assert served.get("completed", {}).get("requests", 0) > 0, served
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert aengine.engine.model_config.name == BASE_MODEL
    r = httpx.post(f"{url}/v1/completions", headers={"authorization": f"Bearer {key}"}, timeout=120,
                   json={"model": BASE_MODEL, "prompt": "Hello", "max_tokens": 2})
    # The fuzzing may have spent this minute's tokens or revoked the key; neither is a 5xx.
    assert r.status_code in (200, 401, 429), r.text
