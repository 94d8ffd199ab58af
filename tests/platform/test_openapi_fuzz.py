"""Schemathesis over the platform's own OpenAPI schema: every tenant and admin operation, with
generated (valid and invalid) parameters and bodies, must answer without a 5xx and without a hang.

The gateway runs on its own database beside the session's engine; requests carry a tenant key
(tenant routes) or the admin token (admin routes). The tenant's plan bounds what generated
completions may cost (tokens per minute), as it would for a hostile tenant: requests reserving
more are refused with a 429 before reaching the engine.
"""
from __future__ import annotations

import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from adapter_registry.migrate import upgrade
from tessera.app import create_app
from tessera.engine_client.inprocess import InProcessEngineClient
from tessera.settings import PlatformSettings

from .conftest import ADMIN_TOKEN, ServerThread

# Enough examples per operation to reach the refusal paths of every field, few enough that the
# whole run stays around a minute on two cores (FUZZ_EXAMPLES=500 for a longer hunt).
EXAMPLES_PER_OPERATION = int(os.environ.get("FUZZ_EXAMPLES", "25"))
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
    if path.endswith("completions") and isinstance(body, dict) and hash(repr(body)) % 2 == 0:
        body["model"] = BASE_MODEL
    return body


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None,
          suppress_health_check=list(HealthCheck))
def test_no_operation_answers_5xx_or_hangs(case, fuzzed):
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
