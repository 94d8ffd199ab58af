"""Real requests through the platform, then GET /metrics: per-tenant counts, histograms and tokens
move by exactly what the tenants did, quota refusals are counted by reason, the engine's series
are there, and no label can grow without bound."""
from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr

from adapter_registry import services as registry
from adapter_registry.errors import UploadRejected
from tessera.app import create_app
from tessera.engine_client.inprocess import InProcessEngineClient
from tessera_core.context import build_context

from .conftest import ServerThread

BASE = "SmolLM2-135M-Instruct"
DEMO = Path(__file__).resolve().parents[2] / "platform" / "tessera" / "demo_adapters"
MSGS = [{"role": "user", "content": "Say hello."}]


def scrape(url: str, **kw) -> dict[tuple, float]:
    """{(sample name, frozenset(labels)): value} of one /metrics answer."""
    r = httpx.get(f"{url}/metrics", timeout=30, **kw)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 when there is none)."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= lab)


def test_requests_tokens_latency_and_refusals_per_tenant(platform):
    a = platform.tenant()
    b = platform.tenant(requests_per_minute=1)
    before = scrape(platform.url)
    assert value(before, "tessera_requests_total", tenant=a.name) == 0

    client = platform.openai(a)
    usages = []
    for i in range(3):
        r = client.chat.completions.create(model=BASE, messages=MSGS, max_tokens=4 + i, temperature=0)
        usages.append(r.usage)
    chunks = list(client.chat.completions.create(model=BASE, messages=MSGS, max_tokens=5, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    usages.append(chunks[-1].usage)
    rb = platform.openai(b).chat.completions.create(model=BASE, messages=MSGS, max_tokens=3, temperature=0)
    with pytest.raises(openai.RateLimitError):
        platform.openai(b).chat.completions.create(model=BASE, messages=MSGS, max_tokens=3, temperature=0)

    m = scrape(platform.url)
    # Counts: four completed requests for a, one for b; a's refusal count stays empty.
    assert value(m, "tessera_requests_total", tenant=a.name, priority="standard", status="completed") == 4
    assert value(m, "tessera_requests_total", tenant=b.name, status="completed") == 1
    assert value(m, "tessera_requests_total", tenant=a.name, status="error") == 0
    assert value(m, "tessera_quota_refusals_total", tenant=b.name, reason="requests") == 1
    assert value(m, "tessera_quota_refusals_total", tenant=a.name) == 0
    # Tokens: exactly what the responses' usage said.
    assert value(m, "tessera_prompt_tokens_total", tenant=a.name) == sum(u.prompt_tokens for u in usages)
    assert value(m, "tessera_completion_tokens_total", tenant=a.name) == sum(u.completion_tokens for u in usages)
    assert value(m, "tessera_completion_tokens_total", tenant=b.name) == rb.usage.completion_tokens
    # Histograms: one TTFT and one end-to-end observation per request; TPOT for 2+ output tokens.
    for name in ("tessera_request_ttft_seconds", "tessera_request_duration_seconds"):
        assert value(m, f"{name}_count", tenant=a.name, priority="standard") == 4
        assert value(m, f"{name}_bucket", tenant=a.name, le="+Inf") == 4
        assert value(m, f"{name}_sum", tenant=a.name) > 0
    assert value(m, "tessera_request_tpot_seconds_count", tenant=a.name) == sum(u.completion_tokens >= 2 for u in usages)
    # A request's TTFT is within its end-to-end time, so the sums are ordered too.
    assert value(m, "tessera_request_ttft_seconds_sum", tenant=a.name) <= value(
        m, "tessera_request_duration_seconds_sum", tenant=a.name)

    # The in-process engine's series are on the same endpoint.
    assert value(m, "tessera_engine_step_seconds_count") > 0
    # Every prompt token was computed in a step, or found in the prefix cache.
    assert value(m, "tessera_engine_batch_tokens_sum") + value(m, "tessera_engine_prefix_cache_hits_total") >= sum(
        u.prompt_tokens for u in usages)
    assert value(m, "tessera_engine_kv_cache_blocks", state="free") > 0
    assert ("tessera_engine_running_sequences", frozenset({("priority", "realtime")})) in m

    # Bounded labels: tenant/priority/status/reason, never request ids or keys; no adapter
    # series unless metrics_adapter_labels is set.
    allowed = {"tenant", "priority", "status", "reason", "le", "state", "tier", "result", "stage", "outcome", "quantile"}
    for (name, labels) in m:
        if name.startswith("tessera_"):
            assert {k for k, _ in labels} <= allowed, (name, labels)
    assert value(m, "tessera_adapter_requests_total", tenant=a.name) == 0


def upload(platform, tenant: str, name: str, path: Path):
    ctx = build_context(platform.settings)
    with ctx.session_factory() as s:
        return registry.upload_adapter(session=s, store=ctx.store, settings=platform.gateway.registry_settings(),
                                       tenant=registry.get_tenant(session=s, name=tenant), name=name, source=path)


def test_registry_uploads_and_rejections_by_reason(platform, tmp_path):
    t = platform.tenant()
    before = scrape(platform.url)
    assert upload(platform, t.name, "pirate", DEMO / "pirate").status == "ready"
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "adapter_config.json").write_text("{not json")
    (tmp_path / "bad" / "adapter_model.safetensors").write_bytes((DEMO / "pirate" / "adapter_model.safetensors").read_bytes())
    assert upload(platform, t.name, "broken", tmp_path / "bad").status == "rejected"
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "adapter_config.json").write_text("{}")
    (tmp_path / "pickled" / "adapter_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(UploadRejected):
        upload(platform, t.name, "pickled", tmp_path / "pickled")
    m = scrape(platform.url)

    def delta(name, **labels):
        return value(m, name, **labels) - value(before, name, **labels)

    assert delta("tessera_registry_uploads_total", outcome="ready") == 1
    assert delta("tessera_registry_uploads_total", outcome="rejected") == 1
    assert delta("tessera_registry_uploads_total", outcome="refused") == 1
    assert delta("tessera_registry_rejections_total", stage="validation", reason="config") == 1
    assert delta("tessera_registry_rejections_total", stage="upload") == 1


def test_adapter_labels_are_opt_in_and_capped(platform, aengine):
    """With metrics_adapter_labels, each (tenant, adapter) gets its own series up to the cap; later
    adapters share '_other'. Adapters are made through the registry, as tenants upload them."""
    settings = platform.settings.model_copy(update={"metrics_adapter_labels": True, "metrics_max_adapter_labels": 1})
    app = create_app(settings, engine_client=InProcessEngineClient(aengine))
    with ServerThread(app) as server:
        t = platform.tenant()
        upload(platform, t.name, "pirate", DEMO / "pirate")
        upload(platform, t.name, "upper", DEMO / "upper")
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=t.key, max_retries=0, timeout=120)
        for model in ("pirate", "upper", "upper"):
            client.chat.completions.create(model=model, messages=MSGS, max_tokens=2, temperature=0)
        client.chat.completions.create(model=BASE, messages=MSGS, max_tokens=2, temperature=0)
        m = scrape(server.url)
    assert value(m, "tessera_adapter_requests_total", tenant=t.name, adapter="pirate") == 1
    assert value(m, "tessera_adapter_requests_total", tenant=t.name, adapter="_other") == 2
    assert value(m, "tessera_adapter_requests_total", tenant=t.name, adapter="upper") == 0
    assert value(m, "tessera_adapter_request_ttft_seconds_count", tenant=t.name) == 3
    assert value(m, "tessera_requests_total", tenant=t.name) == 4  # base-model requests too


def test_metrics_token_guards_the_endpoint(platform, aengine):
    settings = platform.settings.model_copy(update={"metrics_token": SecretStr("scrape-me-" + "x" * 16)})
    app = create_app(settings, engine_client=InProcessEngineClient(aengine))
    with ServerThread(app) as server:
        assert httpx.get(f"{server.url}/metrics").status_code == 401
        assert httpx.get(f"{server.url}/metrics", headers={"authorization": "Bearer wrong"}).status_code == 401
        scrape(server.url, headers={"authorization": "Bearer scrape-me-" + "x" * 16})


def test_the_tenant_port_of_a_scale_out_gateway_names_no_tenant_without_the_token(platform, aengine):
    """A gateway in the scale-out form (engine workers over HTTP; here its engine client is the
    test's, the settings say http) does not serve /metrics to a caller without the metrics
    token, so tenants cannot read each other's names and traffic there; with the token set,
    Prometheus reads it with the token."""
    t = platform.tenant()
    platform.openai(t).chat.completions.create(model=BASE, messages=MSGS, max_tokens=2, temperature=0)
    assert t.name in httpx.get(f"{platform.url}/metrics").text  # embedded, on loopback: open
    scale_out = platform.settings.model_copy(update={
        "engine_mode": "http", "engine_urls": ["http://127.0.0.1:9"], "engine_secret": SecretStr("s" * 16)})
    with ServerThread(create_app(scale_out, engine_client=InProcessEngineClient(aengine))) as server:
        r = httpx.get(f"{server.url}/metrics", headers={"authorization": f"Bearer {t.key}"})
        assert r.status_code == 404 and t.name not in r.text
        assert "TESSERA_METRICS_PORT" in r.json()["error"]["message"]
    token = "scrape-me-" + "y" * 16
    with ServerThread(create_app(scale_out.model_copy(update={"metrics_token": SecretStr(token)}),
                                 engine_client=InProcessEngineClient(aengine))) as server:
        r = httpx.get(f"{server.url}/metrics", headers={"authorization": f"Bearer {t.key}"})
        assert r.status_code == 401 and t.name not in r.text
        assert value(scrape(server.url, headers={"authorization": f"Bearer {token}"}), "tessera_requests_total",
                     tenant=t.name) >= 1


def test_engine_worker_serves_its_own_metrics_without_the_secret(aengine):
    """`tessera engine-worker`'s app: /metrics is open to Prometheus (engine series carry no
    tenant data) while the internal API still needs the shared secret."""
    from engine import metrics as engine_metrics
    from tessera.engine_client.worker import create_worker_app

    # The series cover every live engine of the process (one in a real worker; the test process
    # keeps other tests' engines alive too). Hold them so none is collected before the scrape.
    live = list(engine_metrics._engines)
    with ServerThread(create_worker_app(aengine, secret="worker-secret-" + "x" * 16)) as server:
        assert httpx.get(f"{server.url}/internal/info").status_code == 401
        m = scrape(server.url)
    assert value(m, "tessera_engine_step_seconds_count") > 0  # earlier tests ran steps on this engine
    assert aengine.engine in live
    assert value(m, "tessera_engine_kv_cache_blocks") == sum(e.block_manager.num_blocks for e in live)
    assert ("tessera_engine_waiting_sequences", frozenset({("priority", "batch")})) in m
    assert not any(dict(labels).get("tenant") for (name, labels) in m if name.startswith("tessera_engine_"))
