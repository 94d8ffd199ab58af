"""The generated Prometheus rules, checked and unit-tested by promtool (Debian's prometheus
package), the `tessera slo rules` command on a real database, the Grafana dashboard and the
Alertmanager routing (amtool)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tessera.observability import dashboards, rules, slo
from tessera.settings import PlatformSettings

from adapter_registry.migrate import upgrade

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "infra" / "prometheus"
TESSERA = str(Path(sys.executable).parent / "tessera")

needs_promtool = pytest.mark.usefixtures("needs_promtool")  # missing: skip, or fail under CI=true


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@needs_promtool
def test_generated_rules_pass_promtool_check_and_the_burn_rate_unit_tests(tmp_path):
    """Regenerate the fixture rules from objectives.json with the current generator, then run the
    promtool unit tests (infra/prometheus/tests/slo_test.yml): fastburn pages then tickets and goes
    quiet, slowburn only tickets, healthy never alerts, each at the stated times."""
    objectives = rules.objectives_from_file(PROM / "tests" / "objectives.json")
    text = rules.render(objectives)
    assert (PROM / "tests" / "slo.rules.yml").read_text() == text, "regenerate infra/prometheus/tests/slo.rules.yml"
    shutil.copy(PROM / "tests" / "slo_test.yml", tmp_path / "slo_test.yml")
    (tmp_path / "slo.rules.yml").write_text(text)
    check = promtool("check", "rules", "slo.rules.yml", cwd=tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr
    run = promtool("test", "rules", "slo_test.yml", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout


@needs_promtool
def test_a_wrong_expectation_fails_the_rule_tests(tmp_path):
    """The unit tests can fail: expecting the healthy tenant to page makes promtool say so."""
    test = (PROM / "tests" / "slo_test.yml").read_text()
    extra = ("          - exp_labels: {tenant: healthy, slo: availability, severity: page, long_window: 1h, "
             "short_window: 5m}\n")
    marker = "      - eval_time: 30m\n        alertname: TesseraErrorBudgetBurn\n        exp_alerts:\n"
    assert marker in test
    (tmp_path / "slo_test.yml").write_text(test.replace(marker, marker + extra))
    shutil.copy(PROM / "tests" / "slo.rules.yml", tmp_path / "slo.rules.yml")
    run = promtool("test", "rules", "slo_test.yml", cwd=tmp_path)
    assert run.returncode != 0
    assert "healthy" in run.stdout + run.stderr


def test_rules_read_each_tenants_threshold_bucket_and_target():
    o = slo.Objectives(availability_target=0.999, ttft_threshold_ms=750, ttft_target=0.9,
                       tpot_threshold_ms=75, tpot_target=0.99)
    groups = rules.generate({"acme": o, "zeta": slo.DEFAULTS})["groups"]
    by_record = {}
    for g in groups:
        for r in g["rules"]:
            if "record" in r:
                by_record.setdefault(r["record"], []).append(r)
    ttft_1h = [r for r in by_record["tessera:slo_errors:ratio_rate1h"] if r["labels"] == {"tenant": "acme", "slo": "ttft"}]
    assert 'le="0.75"' in ttft_1h[0]["expr"] and 'tenant="acme"' in ttft_1h[0]["expr"]
    tpot = [r for r in by_record["tessera:slo_errors:ratio_rate1h"] if r["labels"] == {"tenant": "acme", "slo": "tpot"}]
    assert 'le="0.075"' in tpot[0]["expr"]
    budgets = {(r["labels"]["tenant"], r["labels"]["slo"]): r["expr"] for r in by_record["tessera:slo_error_budget:ratio"]}
    assert budgets[("acme", "availability")] == "vector(0.001)"
    assert budgets[("acme", "tpot")] == "vector(0.01)"
    assert budgets[("zeta", "availability")] == "vector(0.005)"
    alerts = [r for r in groups[-1]["rules"]]
    assert [(a["labels"]["severity"], a["labels"]["long_window"], a["labels"]["short_window"]) for a in alerts] == [
        ("page", "1h", "5m"), ("page", "6h", "30m"), ("ticket", "1d", "2h"), ("ticket", "3d", "6h")]
    assert "> 14.4" in alerts[0]["expr"] and "> 6" in alerts[1]["expr"]
    assert "> 3" in alerts[2]["expr"] and "> 1" in alerts[3]["expr"]


def test_objectives_file_with_a_bad_threshold_is_refused(tmp_path):
    f = tmp_path / "o.json"
    f.write_text(json.dumps({"tenants": {"acme": {"ttft_threshold_ms": 800}}}))
    with pytest.raises(ValueError, match="acme.*ttft_threshold_ms must be one of"):
        rules.objectives_from_file(f)
    r = subprocess.run([TESSERA, "slo", "rules", "--objectives", str(f), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.startswith("tessera: error: ") and "Traceback" not in r.stderr


@needs_promtool
def test_cli_writes_rules_for_every_tenant_in_the_database(tmp_path):
    """`tessera slo rules` reads tenants and objectives (plan defaults, tenant overrides) from the
    TESSERA_* database and writes a rule file promtool accepts."""
    from tessera import services

    from tessera_core.context import build_context

    settings = PlatformSettings(_env_file=None, database_url=f"sqlite:///{tmp_path}/t.db",
                                object_store_root=tmp_path / "objects")
    upgrade(settings)
    ctx = build_context(settings)
    with ctx.session_factory() as s:
        plan = services.upsert_plan(session=s, name="pro")
        slo.set_plan_objectives(session=s, plan=plan, values={"ttft_threshold_ms": 500})
        acme = services.create_tenant(session=s, name="acme", plan="pro")
        services.create_tenant(session=s, name="globex", plan="pro")
        slo.set_tenant_objectives(session=s, tenant=acme, values={"ttft_threshold_ms": 2000, "availability_target": 0.99})
    ctx.engine.dispose()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    env["TESSERA_DATABASE_URL"] = settings.database_url
    out = tmp_path / "prom"
    r = subprocess.run([TESSERA, "slo", "rules", "--out", str(out), "--check"], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "2 tenants" in r.stdout and "SUCCESS" in r.stdout
    doc = yaml.safe_load((out / "rules" / "tessera-slo.rules.yml").read_text())
    exprs = {(r["labels"]["tenant"], r["labels"]["slo"]): r["expr"] for g in doc["groups"] for r in g["rules"]
             if r.get("record") == "tessera:slo_errors:ratio_rate5m" and "tenant" in r.get("labels", {})}
    assert 'le="2.0"' in exprs[("acme", "ttft")]      # the tenant's override
    assert 'le="0.5"' in exprs[("globex", "ttft")]    # the plan's default
    budgets = {(r["labels"]["tenant"], r["labels"]["slo"]): r["expr"] for g in doc["groups"] for r in g["rules"]
               if r.get("record") == "tessera:slo_error_budget:ratio"}
    assert budgets[("acme", "availability")] == "vector(0.01)"
    assert budgets[("globex", "availability")] == "vector(0.005)"

    r = subprocess.run([TESSERA, "slo", "status", "acme"], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    status = json.loads(r.stdout)
    assert status["objectives"]["ttft"]["threshold_ms"] == 2000 and status["alerts"] == []
    assert status["status"]["availability"]["requests_30d"] == 0
    r = subprocess.run([TESSERA, "slo", "status", "nobody"], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=120)
    assert r.returncode == 2 and "not found" in r.stderr and "Traceback" not in r.stderr


@needs_promtool
def test_committed_rules_and_prometheus_config_are_valid():
    assert (PROM / rules.RULES_FILE).read_text() == rules.render({}), "regenerate infra/prometheus/rules (no tenants)"
    check = promtool("check", "config", "prometheus.yml", cwd=PROM)  # also checks the rule files it loads
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS" in check.stdout + check.stderr


def test_dashboard_is_current_and_queries_the_tenant():
    committed = json.loads((ROOT / "infra" / "grafana" / dashboards.DASHBOARD_FILE).read_text())
    assert committed == dashboards.dashboard(), "regenerate with `tessera slo dashboard`"
    exprs = [t["expr"] for p in committed["panels"] for t in p["targets"]]
    assert all('tenant="$tenant"' in e for e in exprs)
    titles = " ".join(p["title"] for p in committed["panels"]).lower()
    for word in ("first token", "per output token", "tokens per second", "quota", "burn rate", "budget"):
        assert word in titles
    assert {v["name"] for v in committed["templating"]["list"]} == {"datasource", "tenant"}


@pytest.mark.usefixtures("needs_amtool")
def test_alertmanager_routes_by_severity_and_tenant():
    cfg = str(ROOT / "infra" / "alertmanager" / "alertmanager.yml")
    check = subprocess.run(["amtool", "check-config", cfg], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr

    def route(*labels: str) -> str:
        r = subprocess.run(["amtool", "config", "routes", "test", f"--config.file={cfg}", *labels],
                           capture_output=True, text=True, timeout=60)
        return r.stdout.strip()

    assert route("alertname=TesseraErrorBudgetBurn", "tenant=globex", "severity=page") == "pager"
    assert route("alertname=TesseraErrorBudgetBurn", "tenant=globex", "severity=ticket") == "tickets"
    assert route("alertname=TesseraErrorBudgetBurn", "tenant=acme", "severity=page") == "acme-customer-success,pager"
