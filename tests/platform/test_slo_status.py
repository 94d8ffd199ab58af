"""Per-tenant SLOs through the admin API: objectives inherit from the plan and can be overridden,
the status (burn rates, budget left, firing alerts) follows what the tenant's requests did, from
the usage events, and from a real Prometheus scraping the platform and evaluating the generated
rules (marked `prometheus`: `make test-prometheus` runs it alone)."""
from __future__ import annotations

import subprocess
import time

import httpx
import openai
import pytest
import yaml
from sqlalchemy import select
from tessera.app import create_app
from tessera.engine_client import EngineUnavailable
from tessera.engine_client.inprocess import InProcessEngineClient
from tessera.observability import rules, slo

from adapter_registry.models import Tenant as TenantRow

from .conftest import Platform, ServerThread, free_port

BASE = "SmolLM2-135M-Instruct"
MSGS = [{"role": "user", "content": "Say hello."}]
PAIRS = {("page", "1h", "5m"), ("page", "6h", "30m"), ("ticket", "1d", "2h"), ("ticket", "3d", "6h")}


class FailingFor:
    """The real in-process engine client, except that requests of tenants in `failing` find no
    engine (the gateway answers 503 and records an error): an outage that hits one tenant."""

    def __init__(self, inner):
        self.inner = inner
        self.tokenizer, self.model_name, self.max_model_len = inner.tokenizer, inner.model_name, inner.max_model_len
        self.failing: set[str] = set()

    async def generate(self, request):
        if request.tenant_id in self.failing:
            raise EngineUnavailable("no engine holds this tenant's requests (test outage)")
        async for out in self.inner.generate(request):
            yield out

    async def start(self):
        await self.inner.start()

    async def close(self):
        await self.inner.close()


def tenant_id(p: Platform, name: str) -> str:
    with p.gateway.session_factory() as s:
        return str(s.scalar(select(TenantRow.id).where(TenantRow.name == name)))


def traffic(p: Platform, good, bad, n: int = 2) -> None:
    for _ in range(n):
        p.openai(good).chat.completions.create(model=BASE, messages=MSGS, max_tokens=3, temperature=0)
        with pytest.raises(openai.APIStatusError) as e:
            p.openai(bad).chat.completions.create(model=BASE, messages=MSGS, max_tokens=3, temperature=0)
        assert e.value.status_code == 503


@pytest.fixture(scope="module")
def outage(platform_settings, aengine):
    """A platform whose engine client fails the requests of chosen tenants."""
    client = FailingFor(InProcessEngineClient(aengine))
    app = create_app(platform_settings, engine_client=client)
    with ServerThread(app) as server:
        yield Platform(server.url, platform_settings, app), client


def test_objectives_inherit_from_the_plan_and_tenant_overrides_win(outage):
    p, _ = outage
    t = p.tenant()  # on its own plan, named like the tenant
    r = p.admin.get(f"/admin/v1/tenants/{t.name}/slo")
    assert r.status_code == 200, r.text
    assert r.json()["objectives"]["ttft"] == {"threshold_ms": 1000, "target": 0.95}  # built-in default

    r = p.admin.put(f"/admin/v1/plans/{t.name}/slo", json={"ttft_threshold_ms": 500, "availability_target": 0.999})
    assert r.status_code == 200, r.text
    assert r.json()["values"]["ttft_threshold_ms"] == 500 and r.json()["values"]["tpot_target"] is None
    doc = p.admin.get(f"/admin/v1/tenants/{t.name}/slo").json()
    assert doc["plan"] == t.name
    assert doc["objectives"]["ttft"]["threshold_ms"] == 500
    assert doc["objectives"]["availability"]["target"] == 0.999
    assert doc["overrides"]["ttft_threshold_ms"] is None

    doc = p.admin.patch(f"/admin/v1/tenants/{t.name}/slo", json={"ttft_threshold_ms": 2000, "tpot_target": 0.9}).json()
    assert doc["objectives"]["ttft"]["threshold_ms"] == 2000 and doc["overrides"]["ttft_threshold_ms"] == 2000
    assert doc["objectives"]["tpot"] == {"threshold_ms": 100, "target": 0.9}
    doc = p.admin.patch(f"/admin/v1/tenants/{t.name}/slo", json={"ttft_threshold_ms": None}).json()
    assert doc["objectives"]["ttft"]["threshold_ms"] == 500  # back to the plan's

    r = p.admin.patch(f"/admin/v1/tenants/{t.name}/slo", json={"ttft_threshold_ms": 800})
    assert r.status_code == 400 and "ttft_threshold_ms must be one of" in r.json()["error"]["message"]
    r = p.admin.patch(f"/admin/v1/tenants/{t.name}/slo", json={"availability_target": 1.5})
    assert r.status_code == 400 and "availability_target" in r.json()["error"]["message"]
    assert p.admin.patch(f"/admin/v1/tenants/{t.name}/slo", json={"nonsense": 1}).status_code in (400, 422)
    assert p.admin.get("/admin/v1/tenants/no-such-tenant/slo").status_code == 404
    assert httpx.get(f"{p.url}/admin/v1/tenants/{t.name}/slo").status_code == 401  # admin only


def test_status_from_usage_events_burns_for_the_failing_tenant_only(outage):
    p, client = outage
    good, bad = p.tenant(), p.tenant()
    client.failing.add(tenant_id(p, bad.name))
    traffic(p, good, bad, n=2)

    doc = p.admin.get(f"/admin/v1/tenants/{bad.name}/slo").json()
    assert doc["source"] == "usage_events"
    avail = doc["status"]["availability"]
    assert (avail["requests_30d"], avail["bad_30d"], avail["error_ratio_30d"]) == (2, 2, 1.0)
    assert avail["burn_rates"]["5m"] == pytest.approx(200.0)  # 100% errors / 0.5% budget
    assert avail["error_budget_remaining"] == pytest.approx(-199.0)
    assert doc["status"]["ttft"]["requests_30d"] == 0  # failed requests never got a first token
    assert doc["status"]["ttft"]["burn_rates"]["5m"] is None
    assert {(a["slo"], a["severity"], a["long_window"], a["short_window"]) for a in doc["alerts"]} == {
        ("availability", *pair) for pair in PAIRS}

    doc = p.admin.get(f"/admin/v1/tenants/{good.name}/slo").json()
    avail = doc["status"]["availability"]
    assert (avail["requests_30d"], avail["bad_30d"], avail["error_budget_remaining"]) == (2, 0, 1.0)
    assert avail["burn_rates"]["1h"] == 0.0
    assert doc["status"]["ttft"]["requests_30d"] == 2
    assert [a for a in doc["alerts"] if a["slo"] == "availability"] == []

    everyone = p.admin.get("/admin/v1/slo").json()
    names = {d["tenant"] for d in everyone["tenants"]}
    assert {good.name, bad.name} <= names and everyone["source"] == "usage_events"


def test_unreachable_prometheus_falls_back_to_usage_events(outage, platform_settings, aengine):
    p, _ = outage
    settings = platform_settings.model_copy(update={"prometheus_url": f"http://127.0.0.1:{free_port()}"})
    app = create_app(settings, engine_client=InProcessEngineClient(aengine))
    with ServerThread(app) as server:
        t = p.tenant()
        doc = httpx.get(f"{server.url}/admin/v1/tenants/{t.name}/slo", headers=p.admin.headers).json()
    assert doc["source"] == "usage_events"
    assert "could not be read" in doc["source_error"]


def wait_for(fn, what: str, timeout: float = 45.0):
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


@pytest.mark.prometheus
@pytest.mark.usefixtures("needs_prometheus")
def test_real_prometheus_scrapes_the_platform_and_fires_the_generated_alerts(platform_settings, aengine, tmp_path):
    """Prometheus on a loopback port scrapes /metrics every second and evaluates the rules that
    the generator writes from the database; the failing tenant gets exactly its four
    availability alerts, the healthy one none, and the admin API reads both from Prometheus."""
    prom_port = free_port()
    prom_url = f"http://127.0.0.1:{prom_port}"
    settings = platform_settings.model_copy(update={"prometheus_url": prom_url})
    client = FailingFor(InProcessEngineClient(aengine))
    app = create_app(settings, engine_client=client)
    with ServerThread(app) as server:
        p = Platform(server.url, settings, app)
        good, bad = p.tenant(), p.tenant()
        client.failing.add(tenant_id(p, bad.name))
        # Latency on a shared CPU is not what this test is about: give the healthy tenant loose
        # latency objectives (through the API, so the generator reads them from the database).
        assert p.admin.patch(f"/admin/v1/tenants/{good.name}/slo",
                             json={"ttft_threshold_ms": 60000, "tpot_threshold_ms": 1000}).status_code == 200
        with p.gateway.session_factory() as s:
            objectives = {t.tenant: t.objectives for t in slo.all_objectives(session=s) if t.tenant in (good.name, bad.name)}
        rule_file = rules.write(objectives, tmp_path, interval="1s")
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "rule_files": [str(rule_file)],
                  "scrape_configs": [{"job_name": "tessera", "static_configs": [{"targets": [f"127.0.0.1:{server.port}"]}]}]}
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        log = (tmp_path / "prometheus.log").open("w")
        proc = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                                stdout=log, stderr=subprocess.STDOUT)
        prom = httpx.Client(base_url=prom_url, timeout=10)

        def query(q: str) -> dict:
            try:  # until it is ready, Prometheus answers 503 in plain text
                result = prom.get("/api/v1/query", params={"query": q}).json()["data"]["result"]
            except (httpx.HTTPError, ValueError, KeyError):
                return {}
            return {tuple(sorted(x["metric"].items())): float(x["value"][1]) for x in result}

        try:
            wait_for(lambda: query('up{job="tessera"} == 1'), "Prometheus to scrape the platform")
            traffic(p, good, bad, n=1)
            time.sleep(2.5)  # a few scrapes see the counters, so the next requests make a rate
            traffic(p, good, bad, n=2)

            def alerts():
                r = prom.get("/api/v1/alerts").json()["data"]["alerts"]
                mine = [a["labels"] for a in r if a["labels"].get("tenant") in (good.name, bad.name)
                        and a["state"] == "firing"]
                return mine if len(mine) >= 4 else None

            firing = wait_for(alerts, "the failing tenant's alerts")
            time.sleep(2.0)  # a few more evaluations: nothing else may join
            firing = alerts()
            assert {(a["tenant"], a["slo"], a["severity"], a["long_window"], a["short_window"]) for a in firing} == {
                (bad.name, "availability", *pair) for pair in PAIRS}
            burn = query('tessera:slo_burn_rate:rate5m{slo="availability"}')
            by_tenant = {dict(k)["tenant"]: v for k, v in burn.items()}
            assert by_tenant[bad.name] == pytest.approx(200.0)
            assert by_tenant[good.name] == 0.0

            doc = p.admin.get(f"/admin/v1/tenants/{bad.name}/slo").json()
            assert doc["source"] == "prometheus"
            assert doc["status"]["availability"]["burn_rates"]["5m"] == pytest.approx(200.0)
            assert {(a["severity"], a["long_window"], a["short_window"], a["state"]) for a in doc["alerts"]} == {
                (*pair, "firing") for pair in PAIRS}
            doc = p.admin.get(f"/admin/v1/tenants/{good.name}/slo").json()
            assert doc["source"] == "prometheus" and doc["alerts"] == []
            assert doc["status"]["availability"]["burn_rates"]["1h"] == 0.0
            everyone = p.admin.get("/admin/v1/slo").json()
            assert everyone["source"] == "prometheus"
            docs = {d["tenant"]: d for d in everyone["tenants"]}
            assert len(docs[bad.name]["alerts"]) == 4 and docs[good.name]["alerts"] == []
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()
