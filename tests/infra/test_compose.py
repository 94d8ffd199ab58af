"""infra/compose: the compose file as Docker Compose v2 itself reads it (`docker compose config`:
schema validation, anchors, interpolation from the .env file, profiles), then what a user of it
relies on: every part of the scale-out shape is there, every setting is a real one and
validates, probes hit the real endpoints, each engine gets one GPU of its own; and the monitoring
as the real tools read it: Prometheus's config with the rules as mounted (promtool), scraping every
gateway and engine worker and alerting to the project's Alertmanager, whose config amtool accepts;
Grafana's provisioned data source and dashboard, every panel on that data source and every query
PromQL that Prometheus parses (promtool) over series Tessera exports or its rules record."""
from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from tests.infra.tools import REPO, known_env_vars, require_compose
from tests.requirements import require_tool

COMPOSE_DIR = REPO / "infra" / "compose"
COMPOSE_FILE = COMPOSE_DIR / "compose.yaml"
ENV_EXAMPLE = COMPOSE_DIR / ".env.example"
TESSERA_IMAGE = "tessera:latest"
# Variables the image sets (infra/compose/Dockerfile), which the services inherit.
DOCKERFILE_ENV = {"TESSERA_USAGE_OUTBOX_DIR": "/var/lib/tessera/usage-outbox",
                  "TESSERA_ADAPTER_CACHE_DIR": "/var/lib/tessera/adapter-cache",
                  "TESSERA_KERNEL_CACHE": "/var/lib/tessera/kernels", "TESSERA_HOST": "0.0.0.0"}


def compose_config(*args: str, env_file=ENV_EXAMPLE) -> subprocess.CompletedProcess:
    cmd = require_compose()
    return subprocess.run([*cmd, "-f", str(COMPOSE_FILE), "--env-file", str(env_file), *args, "config",
                           "--format", "json"], capture_output=True, text=True, timeout=60)


@functools.cache
def resolved(profile: str) -> dict:
    """The project as compose resolves it with .env.example and `--profile profile`."""
    done = compose_config("--profile", profile)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module", params=["gpu", "cpu"])
def project(request) -> dict:
    return resolved(request.param) | {"profile": request.param}


def tessera_services(project: dict) -> dict[str, dict]:
    return {name: s for name, s in project["services"].items() if s.get("image") == TESSERA_IMAGE}


def engines(project: dict) -> dict[str, dict]:
    return {name: s for name, s in tessera_services(project).items() if s["command"][:2] == ["tessera", "engine-worker"]}


def option(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def healthcheck_url(service: dict) -> str:
    """The URL a healthcheck command opens (they are `python -c "...urlopen('URL')..."`)."""
    test = " ".join(service["healthcheck"]["test"])
    match = re.search(r"urlopen\('([^']+)'", test)
    assert match, f"no URL in healthcheck {test}"
    return match.group(1)


def test_every_part_of_the_scale_out_shape_is_there(project):
    services = project["services"]
    commands = {name: " ".join(s.get("command") or []) for name, s in services.items()}
    assert services["gateway"]["command"] == ["tessera", "serve"]
    assert services["gateway"]["deploy"]["replicas"] >= 2
    assert len(engines(project)) == 2
    # Both Celery apps have a worker on their queue, and billing has its beat.
    assert any("-A adapter_registry.tasks worker -Q adapter-registry" in c for c in commands.values())
    assert any("-A tessera.billing.tasks worker -Q billing" in c for c in commands.values())
    assert any("-A tessera.billing.tasks beat" in c for c in commands.values())
    assert services["migrate"]["command"][:1] == ["alembic"] and services["migrate"]["command"][-2:] == ["upgrade", "head"]
    assert services["postgres"]["image"].startswith("postgres:")
    assert services["redis"]["image"].startswith("redis:")
    assert services["minio"]["image"].startswith("minio/minio")
    assert "mc mb" in " ".join(services["create-bucket"]["command"])
    for name in ("prometheus", "alertmanager", "grafana"):
        assert services[name]["image"].startswith(("prom/", "grafana/"))


def test_celery_queues_are_the_settings_defaults():
    # The worker commands name queues literally; they must be those the gateway sends to.
    from tessera.settings import PlatformSettings

    services = resolved("cpu")["services"]
    defaults = PlatformSettings()
    assert option(services["celery-worker"]["command"], "-Q") == defaults.celery_queue
    assert option(services["celery-billing-worker"]["command"], "-Q") == defaults.billing_queue


def test_every_tessera_variable_is_a_real_setting_and_validates(project):
    from tessera.settings import PlatformSettings

    known = known_env_vars()
    for name, service in tessera_services(project).items():
        env = DOCKERFILE_ENV | service.get("environment", {})
        unknown = sorted(k for k in env if k.startswith("TESSERA_") and k not in known)
        assert not unknown, f"{name} sets variables no Tessera code reads: {unknown}"
        other = sorted(k for k in env if not k.startswith("TESSERA_"))
        assert not other, f"{name} is configured outside the settings: {other}"
        # The whole environment builds valid settings (as the process does at start).
        fields = {k.removeprefix("TESSERA_").lower(): v for k, v in env.items()
                  if k.removeprefix("TESSERA_").lower() in PlatformSettings.model_fields}
        if "engine_urls" in fields:
            fields["engine_urls"] = json.loads(fields["engine_urls"])
        settings = PlatformSettings(**fields)
        assert settings.database_url.startswith("postgresql+psycopg2://")
        assert settings.object_store == "s3" and settings.celery_eager is False and settings.redis_url


def test_gateways_reach_every_engine_by_a_name_compose_resolves(project):
    gateway_env = project["services"]["gateway"]["environment"]
    assert gateway_env["TESSERA_ENGINE_MODE"] == "http"
    urls = [urlparse(u) for u in json.loads(gateway_env["TESSERA_ENGINE_URLS"])]
    # Each URL names exactly one engine service (by its name or a network alias) on its port,
    # and each engine is named by exactly one URL.
    reached = []
    for name, service in engines(project).items():
        aliases = ((service.get("networks") or {}).get("default") or {}).get("aliases") or []
        port = int(option(service["command"], "--port"))
        hits = [u for u in urls if u.hostname in (name, *aliases) and u.port == port]
        assert len(hits) == 1, f"{name} is reached by {len(hits)} of the gateways' engine URLs"
        reached += hits
    assert len(reached) == len(urls) == 2


def test_probes_hit_the_real_endpoints_on_the_served_ports(project):
    from tessera.api.probes import router as gateway_routes
    from tessera.engine_client.worker import router as worker_routes

    gateway_paths = {r.path for r in gateway_routes.routes}
    worker_paths = {r.path for r in worker_routes.routes}
    gateway = project["services"]["gateway"]
    url = urlparse(healthcheck_url(gateway))
    assert url.path in gateway_paths and url.path in ("/health", "/ready")
    assert url.port == int(gateway["environment"]["TESSERA_PORT"])
    assert {p["target"] for p in gateway["ports"]} == {url.port}
    for name, service in engines(project).items():
        url = urlparse(healthcheck_url(service))
        assert url.path == "/ready" and url.path in worker_paths, name
        assert url.port == int(option(service["command"], "--port")), name
        # The worker binds every interface, or the gateways could not reach it.
        assert option(service["command"], "--host") == "0.0.0.0"


def test_prometheus_scrapes_the_gateways_on_their_unpublished_metrics_port(project):
    """/metrics names every tenant: the gateways serve it on TESSERA_METRICS_PORT, which the host
    does not publish, and Prometheus (on the compose network) scrapes every replica there."""
    gateway = project["services"]["gateway"]
    metrics_port = int(gateway["environment"]["TESSERA_METRICS_PORT"])
    assert metrics_port not in {p["target"] for p in gateway["ports"]}
    config = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "tessera-gateway"]
    (sd,) = job["dns_sd_configs"]
    assert job["metrics_path"] == "/metrics" and sd["names"] == ["gateway"] and sd["port"] == metrics_port


def bind_mounts(project: dict, service: str) -> dict[str, str]:
    """A service's bind mounts: the path in the container -> the path here."""
    return {v["target"]: v["source"] for v in project["services"][service]["volumes"] if v["type"] == "bind"}


def names_of(project: dict, service: str) -> set[str]:
    """The names a service answers to on the compose network: its own and its aliases."""
    aliases = ((project["services"][service].get("networks") or {}).get("default") or {}).get("aliases") or []
    return {service, *aliases}


def test_prometheus_scrapes_every_engine_worker_on_its_served_port(project):
    """Every engine worker (both profiles) is a target of the engine job, by a name compose
    resolves and the port its command serves (/metrics there is open: no tenant data in it,
    and it carries the inference extension's model-server series)."""
    from tessera.engine_client.worker import _OPEN_PATHS

    config = yaml.safe_load(Path(bind_mounts(project, "prometheus")["/etc/prometheus/prometheus.yml"]).read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "tessera-engine"]
    assert job["metrics_path"] == "/metrics" and job["metrics_path"] in _OPEN_PATHS
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    scraped = []
    for name, service in engines(project).items():
        port = int(option(service["command"], "--port"))
        hits = [t for t in targets
                if t.rsplit(":", 1)[0] in names_of(project, name) and int(t.rsplit(":", 1)[1]) == port]
        assert len(hits) == 1, f"{name} is scraped by {len(hits)} targets"
        scraped += hits
    assert sorted(scraped) == sorted(targets)


def test_prometheus_alerts_to_the_projects_alertmanager_whose_config_amtool_accepts(project, tmp_path):
    require_tool("amtool")
    config = yaml.safe_load(Path(bind_mounts(project, "prometheus")["/etc/prometheus/prometheus.yml"]).read_text())
    (am,) = config["alerting"]["alertmanagers"]
    (target,) = [t for sc in am["static_configs"] for t in sc["targets"]]
    host, port = target.rsplit(":", 1)
    alertmanager = project["services"]["alertmanager"]
    # Alertmanager listens on its default port (9093) unless its command names another.
    listen = next((a.split("=", 1)[1] for a in alertmanager["command"] if a.startswith("--web.listen-address=")),
                  ":9093")
    assert host in names_of(project, "alertmanager") and port == listen.rsplit(":", 1)[1]
    assert {p["target"] for p in alertmanager["ports"]} == {int(port)}
    config_file = bind_mounts(project, "alertmanager")["/etc/alertmanager/alertmanager.yml"]
    assert "--config.file=/etc/alertmanager/alertmanager.yml" in alertmanager["command"]
    done = subprocess.run(["amtool", "check-config", config_file], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr


def grafana_provisioning(project: dict) -> tuple[list[dict], list[dict], Path]:
    """Grafana's provisioned data sources and dashboard providers (read from the folder compose
    mounts at /etc/grafana/provisioning), and where the providers' path is on this machine."""
    mounts = bind_mounts(project, "grafana")
    root = Path(mounts["/etc/grafana/provisioning"])
    datasources = [d for f in sorted((root / "datasources").glob("*.y*ml"))
                   for d in yaml.safe_load(f.read_text())["datasources"]]
    providers = [p for f in sorted((root / "dashboards").glob("*.y*ml"))
                 for p in yaml.safe_load(f.read_text())["providers"]]
    (provider,) = providers
    assert provider["type"] == "file"
    return datasources, providers, Path(mounts[provider["options"]["path"]])


def test_grafana_provisions_prometheus_and_the_tenant_dashboard(project):
    datasources, _, dashboards = grafana_provisioning(project)
    (prometheus,) = [d for d in datasources if d["type"] == "prometheus"]
    url = urlparse(prometheus["url"])
    assert url.hostname in names_of(project, "prometheus") and prometheus["access"] == "proxy"
    assert url.port in {p["target"] for p in project["services"]["prometheus"]["ports"]}
    assert prometheus["isDefault"] is True
    assert (dashboards / "tessera-tenant-slo.json").is_file()


def panels(dashboard: dict):
    """Every panel, those inside collapsed rows too."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def test_every_dashboard_panel_reads_the_provisioned_prometheus_with_queries_promtool_parses(project, tmp_path):
    """Each dashboard file is JSON Grafana can load (uid, title, panels with ids and positions);
    every panel and query uses the `datasource` variable, which lists Prometheus data sources
    and so resolves to the provisioned one (the only one, and the default); every query is PromQL
    that promtool parses, once Grafana's variables are put in; and every series a query reads is
    one the gateways export or the SLO rules record."""
    require_tool("promtool")
    from prometheus_client import REGISTRY

    import tessera.observability.metrics  # noqa: F401  (registers the gateway's series)
    from tessera.observability import slo_definitions

    datasources, _, folder = grafana_provisioning(project)
    (provisioned,) = [d for d in datasources if d["type"] == "prometheus"]
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    exported = {f.name + suffix for f in REGISTRY.collect() for suffix in suffixes.get(f.type, ("",))}
    recorded = (slo_definitions.ERROR_RATIO, slo_definitions.BUDGET, slo_definitions.BURN_RATE,
                slo_definitions.BUDGET_REMAINING)
    files = sorted(folder.glob("*.json"))
    assert files
    rules, uses = [], []
    for path in files:
        dashboard = json.loads(path.read_text())
        assert dashboard["uid"] and dashboard["title"] and dashboard["panels"], path.name
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        ds = variables["datasource"]
        assert ds["type"] == "datasource" and ds["query"] == provisioned["type"]
        ids = [p["id"] for p in panels(dashboard)]
        assert len(ids) == len(set(ids)), f"{path.name}: panel ids repeat"
        for panel in panels(dashboard):
            if panel["type"] == "row":
                continue
            assert set(panel["gridPos"]) == {"x", "y", "w", "h"}, panel["title"]
            for holder in (panel, *panel["targets"]):
                assert holder["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            uses += [(path.name, panel["title"], t["expr"]) for t in panel["targets"]]
        for v in variables.values():
            if v["type"] == "query":
                assert v["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
                match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", v["query"]["query"])
                assert match, v["query"]
                uses.append((path.name, f"variable {v['name']}", match.group(1)))
    for i, (name, title, expr) in enumerate(uses):
        # Grafana's variables as values: $tenant, ${tenant}, and its interval variables.
        promql = re.sub(r"\$__\w+", "5m", expr)
        promql = re.sub(r"\$\{?(\w+)\}?", "example", promql)
        rules.append({"record": f"dashboard:query:{i}", "expr": promql})
        for series in re.findall(r"\b(tessera[_:][A-Za-z0-9_:]*)", promql):
            assert series in exported or series.startswith(recorded), f"{name} / {title}: {series} is not exported"
    (tmp_path / "queries.yml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run(["promtool", "check", "rules", str(tmp_path / "queries.yml")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules)} rules found" in done.stdout


def test_the_query_check_is_not_vacuous(tmp_path):
    """promtool refuses a query that is not PromQL, as the dashboard check relies on."""
    require_tool("promtool")
    bad = {"groups": [{"name": "dashboard", "rules": [{"record": "dashboard:query:0",
                                                       "expr": 'sum(rate(tessera_requests_total{tenant="x"}[5m])'}]}]}
    (tmp_path / "queries.yml").write_text(yaml.safe_dump(bad))
    done = subprocess.run(["promtool", "check", "rules", str(tmp_path / "queries.yml")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0


def test_each_gpu_engine_reserves_one_gpu_of_its_own():
    project = resolved("gpu")
    seen = []
    for name, service in engines(project).items():
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1, name
        (device,) = devices
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        assert len(device["device_ids"]) == 1, f"{name} must reserve exactly one GPU"
        assert service["environment"]["TESSERA_ENGINE_DEVICE"] == "cuda"
        seen += device["device_ids"]
    assert len(seen) == len(set(seen)) == 2, f"engines share a GPU: {seen}"


def test_the_cpu_profile_runs_without_any_gpu():
    project = resolved("cpu")
    for name, service in project["services"].items():
        assert "devices" not in ((service.get("deploy") or {}).get("resources") or {}).get("reservations", {}), name
    for name, service in engines(project).items():
        assert service["environment"]["TESSERA_ENGINE_DEVICE"] == "cpu"


def test_monitoring_mounts_the_generated_rules_and_dashboards(project):
    def bind_sources(service: str) -> dict[str, str]:
        return {v["target"]: v["source"] for v in project["services"][service]["volumes"] if v["type"] == "bind"}

    prometheus = bind_sources("prometheus")
    assert prometheus["/etc/prometheus/rules"] == str(REPO / "infra/prometheus/rules")
    assert (REPO / "infra/prometheus/rules/tessera-slo.rules.yml").is_file()
    assert prometheus["/etc/prometheus/prometheus.yml"] == str(COMPOSE_DIR / "prometheus.yml")
    assert bind_sources("alertmanager")["/etc/alertmanager/alertmanager.yml"] == str(REPO / "infra/alertmanager/alertmanager.yml")
    dashboards = bind_sources("grafana")["/var/lib/grafana/dashboards/tessera"]
    assert dashboards == str(REPO / "infra/grafana") and (REPO / "infra/grafana/tessera-tenant-slo.json").is_file()


def test_promtool_accepts_the_prometheus_config_with_the_rules_as_mounted(tmp_path):
    require_tool("promtool")
    mounts = {v["target"]: v["source"] for v in resolved("cpu")["services"]["prometheus"]["volumes"] if v["type"] == "bind"}
    # /etc/prometheus as the container sees it: the config and the rules folder beside it.
    shutil.copy(mounts["/etc/prometheus/prometheus.yml"], tmp_path / "prometheus.yml")
    (tmp_path / "rules").symlink_to(mounts["/etc/prometheus/rules"])
    done = subprocess.run(["promtool", "check", "config", str(tmp_path / "prometheus.yml")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tessera-slo.rules.yml" in done.stdout and "rules found" in done.stdout


def test_start_order_migrates_and_creates_the_bucket_before_any_tessera_process(project):
    for name, service in tessera_services(project).items():
        if name == "migrate":
            assert service["depends_on"]["postgres"]["condition"] == "service_healthy"
            continue
        deps = service["depends_on"]
        assert deps["migrate"]["condition"] == "service_completed_successfully", name
        assert deps["create-bucket"]["condition"] == "service_completed_successfully", name


def test_a_missing_secret_is_refused_by_name(tmp_path):
    env = tmp_path / ".env"
    env.write_text("\n".join(line for line in ENV_EXAMPLE.read_text().splitlines()
                             if not line.startswith("TESSERA_ENGINE_SECRET=")))
    done = compose_config("--profile", "cpu", env_file=env)
    assert done.returncode != 0
    assert "set TESSERA_ENGINE_SECRET in .env" in done.stderr


def test_env_example_lists_every_variable_the_file_interpolates():
    text = COMPOSE_FILE.read_text()
    # ${NAME}, ${NAME:-default}, ${NAME:?message}; $$NAME is a literal for the container's shell.
    used = set(re.findall(r"(?<!\$)\$\{([A-Z0-9_]+)", text))
    listed = {line.split("=", 1)[0] for line in ENV_EXAMPLE.read_text().splitlines()
              if line and not line.startswith("#")}
    assert used - listed == set()


def test_the_migration_job_finds_alembic_ini_where_the_image_puts_the_repository():
    dockerfile = (COMPOSE_DIR / "Dockerfile").read_text()
    assert "WORKDIR /app" in dockerfile and "COPY . /app" in dockerfile
    migrate = resolved("cpu")["services"]["migrate"]["command"]
    assert migrate[migrate.index("-c") + 1] == "/app/alembic.ini" and (REPO / "alembic.ini").is_file()
    # The image's ENV lines are the ones this test module assumes for every service.
    env = dict(re.findall(r"(TESSERA_[A-Z_]+)=(\S+)", dockerfile))
    assert env == DOCKERFILE_ENV
