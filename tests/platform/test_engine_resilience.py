"""One tenant cannot take the engine down for the others, through the public API: extreme but
accepted sampling values and an adapter whose scale overflows the engine's arithmetic fail (or
serve) only their own requests, while another tenant's stream is unchanged, and afterwards the
platform is healthy, ready and serving."""
from __future__ import annotations

import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

import engine.async_engine as async_engine_module
from adapter_registry import services as registry
from adapter_registry.content import blob_key, sha256_file, version_digest
from adapter_registry.models import Adapter, AdapterVersion, Blob
from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tessera.app import create_app
from tessera.engine_client.inprocess import InProcessEngineClient
from tessera.engine_client.worker import create_worker_app
from tessera_core.context import build_context
from tests.engine.faults import EngineFaults
from tests.engine.lora_fixtures import write_random_adapter

from .conftest import ServerThread

BASE = "SmolLM2-135M-Instruct"
# A continuation the model is sure of, token after token: its text does not depend on what else
# shares the engine's batches.
COUNTING = "1, 2, 3, 4, 5, 6, 7,"


def _post(platform, tenant, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{platform.url}{path}", json=body, headers={"authorization": f"Bearer {tenant.key}"},
                      timeout=120)


def _stream_text(platform, tenant, started: threading.Event | None = None, max_tokens: int = 24) -> str:
    """A greedy streamed completion of COUNTING; sets `started` at its first chunk."""
    body = {"model": BASE, "prompt": COUNTING, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    text = ""
    with httpx.stream("POST", f"{platform.url}/v1/completions", json=body, timeout=120,
                      headers={"authorization": f"Bearer {tenant.key}"}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text += chunk["choices"][0]["text"]
            if started is not None:
                started.set()
    return text


def _while_streaming(platform, tenant, other):
    """Run `other()` once `tenant`'s stream has begun; returns (the stream's text, other's result)."""
    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(_stream_text, platform, tenant, started)
        assert started.wait(120), "the stream never started"
        result = other()
        return stream.result(timeout=120), result


def _assert_healthy(platform, tenant) -> None:
    health = httpx.get(f"{platform.url}/health", timeout=30)
    assert health.status_code == 200 and health.json()["engine"]["state"] == "ready", health.text
    ready = httpx.get(f"{platform.url}/ready", timeout=30)
    assert ready.status_code == 200 and ready.json()["status"] == "ready", ready.text
    r = _post(platform, tenant, "/v1/completions", {"model": BASE, "prompt": "Hello", "max_tokens": 4})
    assert r.status_code == 200, r.text


# Accepted values at the edges of their ranges, and a few just outside.
EXTREMES = [
    {"temperature": 1e-30},
    {"temperature": 5e-324},
    {"temperature": 1e-30, "seed": -(2**63)},
    {"temperature": 2.0, "top_p": 5e-324},
    {"temperature": 2.0, "top_p": 1e-30, "top_k": 1},
    {"temperature": 2.0, "top_k": 10**20, "seed": 2**63 - 1},
    {"temperature": 1.7, "top_p": 1.0, "seed": 0},
    {"temperature": 1e-30, "seed": 2**63},  # outside int64: refused
    {"temperature": 2.0000001},             # refused
    {"top_p": 0},                           # refused
]


def test_extreme_sampling_values_never_disturb_another_tenant(platform):
    a, b = platform.tenant(), platform.tenant()
    alone = _stream_text(platform, a)

    def tenant_b():
        def one(extra):
            body = {"model": BASE, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 8,
                    **extra}
            return extra, _post(platform, b, "/v1/chat/completions", body)
        with ThreadPoolExecutor(4) as pool:
            return list(pool.map(one, EXTREMES))

    text, results = _while_streaming(platform, a, tenant_b)
    assert text == alone
    for extra, r in results:
        assert r.status_code == 200 or 400 <= r.status_code < 500, (extra, r.status_code, r.text)
        if r.status_code == 200:
            assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        else:
            msg = r.json()["error"]["message"]
            assert any(name in msg for name in extra), (extra, msg)  # it names the parameter
    assert [r.status_code for _, r in results[-3:]] != [200, 200, 200]
    _assert_healthy(platform, b)


def _write_version_directly(platform, tenant_name: str, name: str, path: Path) -> str:
    """Store the adapter at `path` as a ready version, as a registry without upload validation
    would (the registry's validation refuses an overflowing scale)."""
    ctx = build_context(platform.settings)
    files = [path / "adapter_config.json", path / "adapter_model.safetensors"]
    (config_sha, _), (weights_sha, weights_size) = (sha256_file(f) for f in files)
    with ctx.session_factory() as s:
        tenant = registry.get_tenant(session=s, name=tenant_name)
        for f in files:
            sha, size = sha256_file(f)
            ctx.store.put_file(blob_key(sha), f)
            s.add(Blob(sha256=sha, object_key=blob_key(sha), size_bytes=size))
        adapter = Adapter(tenant_id=tenant.id, name=name, next_version=2)
        s.add(adapter)
        s.flush()
        cfg = json.loads(files[0].read_text())
        version = AdapterVersion(
            adapter=adapter, version=1, sha256=version_digest(config_sha, weights_sha), config_sha256=config_sha,
            weights_sha256=weights_sha, object_key=blob_key(weights_sha), config_object_key=blob_key(config_sha),
            size_bytes=weights_size, status="ready", base_model=BASE, rank=cfg["r"], alpha=cfg["lora_alpha"],
            use_rslora=False, target_modules=cfg["target_modules"], dtype="F32")
        s.add(version)
        s.flush()
        adapter.current_version_id = version.id
        s.commit()
        return version.sha256


def _version_status(platform, sha: str) -> str:
    ctx = build_context(platform.settings)
    with ctx.session_factory() as s:
        return s.scalar(select(AdapterVersion.status).where(AdapterVersion.sha256 == sha))


def test_overflowing_adapter_fails_only_its_request_and_is_quarantined(platform, aengine, tmp_path):
    a, b = platform.tenant(), platform.tenant()
    path = write_random_adapter(tmp_path / "overflow", 8, alpha=1e30, seed=uuid.uuid4().int % 10**6)
    sha = _write_version_directly(platform, b.name, "overflow", path)
    alone = _stream_text(platform, a)

    def tenant_b():
        body = {"model": "overflow", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8,
                "temperature": 0.7, "stream": True}
        with httpx.stream("POST", f"{platform.url}/v1/chat/completions", json=body, timeout=120,
                          headers={"authorization": f"Bearer {b.key}"}) as r:
            if r.status_code != 200:  # failed before its first token: an error status, not a stream
                return r.status_code, [json.loads(r.read())]
            return r.status_code, [json.loads(line[6:]) for line in r.iter_lines()
                                   if line.startswith("data: ") and line != "data: [DONE]"]

    text, (status, events) = _while_streaming(platform, a, tenant_b)
    assert text == alone
    errors = [e["error"] for e in events if "error" in e]
    # Before its first token: a 409; after some: the stream's last event. Either way the
    # tenant's adapter is named as the cause, not the platform (no 5xx).
    assert status in (200, 409) and len(errors) == 1, (status, events)
    assert errors[0]["code"] == "adapter_quarantined", errors[0]
    assert "non-finite" in errors[0]["message"] and "quarantined" in errors[0]["message"], errors[0]
    assert aengine.engine.lora_manager.is_quarantined(sha)

    deadline = time.monotonic() + 30
    while _version_status(platform, sha) != "quarantined":
        assert time.monotonic() < deadline, "the registry never quarantined the version"
        time.sleep(0.05)
    # Later requests for it fail at once with the reason, and never reach the model.
    again = _post(platform, b, "/v1/chat/completions",
                  {"model": "overflow@1", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert again.status_code == 409, again.text
    assert "quarantined" in again.json()["error"]["message"], again.text
    _assert_healthy(platform, a)
    _assert_healthy(platform, b)


@pytest.mark.parametrize("path", ["/health", "/ready"])
def test_health_and_ready_need_no_credentials_and_carry_no_tenant_data(platform, path):
    r = httpx.get(f"{platform.url}{path}", timeout=30)
    assert r.status_code == 200
    assert set(r.json()) <= {"status", "engine"} and set(r.json()["engine"]) <= {
        "ready", "state", "reason", "restarts", "engines"}


def _wait_ready_status(url: str, status: int, timeout: float = 60.0) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(f"{url}/ready", timeout=30)
        if r.status_code == status:
            return r
        assert time.monotonic() < deadline, f"/ready stayed {r.status_code}: {r.text}"
        time.sleep(0.02)


def test_a_dead_step_loop_is_restarted_and_ready_reports_it(platform, platform_settings, monkeypatch):
    """An engine of its own (the shared one must stay healthy), behind a gateway and an engine
    worker: its step loop dies and its resets fail until released; meanwhile both answer /ready
    503 with the reason and /health 200 with the engine's state, and requests get 503; then it
    serves again in the same process."""
    monkeypatch.setattr(async_engine_module, "RESET_BACKOFF_S", (0.01, 0.05))
    eng = LLMEngine(config=EngineConfig(weight_format="fp32", kv_cache_bytes=8 << 20))
    faults = EngineFaults(eng, monkeypatch, step=True, reset=True)
    aengine = AsyncLLMEngine(eng)
    tenant = platform.tenant()
    body = {"model": BASE, "prompt": COUNTING, "max_tokens": 8, "temperature": 0, "stream": True}
    try:
        with ServerThread(create_app(platform_settings, engine_client=InProcessEngineClient(aengine))) as server, \
                ServerThread(create_worker_app(aengine, secret="worker-secret")) as worker:
            headers = {"authorization": f"Bearer {tenant.key}"}
            assert httpx.get(f"{worker.url}/ready", timeout=30).status_code == 200
            dead = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=120)
            assert dead.status_code == 503 or "error" in dead.text, dead.text  # in flight when the loop died
            r = _wait_ready_status(server.url, 503)
            assert r.json()["engine"]["state"] in ("restarting", "failed") and r.json()["reason"], r.text
            health = httpx.get(f"{server.url}/health", timeout=30)
            assert health.status_code == 200 and health.json()["engine"]["state"] in ("restarting", "failed")
            refused = httpx.post(f"{server.url}/v1/completions", json=body | {"stream": False}, headers=headers,
                                 timeout=120)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable"
            # The worker: no secret needed for its probes; its generate route answers 503 so the
            # gateway's HTTP client tries the next worker.
            w = _wait_ready_status(worker.url, 503)
            assert w.json()["engine"]["state"] in ("restarting", "failed")
            assert httpx.get(f"{worker.url}/health", timeout=30).json()["engine"]["state"] in ("restarting", "failed")
            internal = httpx.post(f"{worker.url}/internal/generate", timeout=30,
                                  headers={"authorization": "Bearer worker-secret"},
                                  json={"request_id": "w1", "prompt_token_ids": [1, 2, 3], "params": {"max_tokens": 2}})
            assert internal.status_code == 503

            faults.reset = False
            ready = _wait_ready_status(server.url, 200).json()
            assert ready["engine"]["state"] == "ready" and ready["engine"]["restarts"] == 1
            served = httpx.post(f"{server.url}/v1/completions", json=body | {"stream": False}, headers=headers,
                                timeout=120)
            assert served.status_code == 200 and served.json()["choices"][0]["text"], served.text
            assert _wait_ready_status(worker.url, 200).json()["engine"]["restarts"] == 1
    finally:
        aengine.shutdown()
