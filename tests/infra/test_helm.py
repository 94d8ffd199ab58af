"""infra/helm/tessera: the chart as Helm itself lints and renders it (Helm's Go SDK, through the
helm-python-sdk wheel), every rendered manifest validated against the Kubernetes API schemas
(kubernetes-validate, strict: unknown fields are errors) for the oldest Kubernetes the chart
supports and the newest the validator knows; then what an operator relies on: every component is
there, settings are real and valid, probes hit the real endpoints, one GPU per engine replica,
and the gateways address every engine replica by its stable name."""
from __future__ import annotations

import functools
import json
from urllib.parse import urlparse

import pytest
import yaml

from tests.infra.tools import REPO, known_env_vars, require_helm, require_kubernetes_validate

CHART = REPO / "infra" / "helm" / "tessera"
RELEASE, NAMESPACE = "tessera", "inference"
OLDEST_KUBERNETES = "1.25.0"  # Chart.yaml's kubeVersion

EXTERNAL = {
    "database": {"url": "postgresql+psycopg2://tessera:pw@db.example.internal:5432/tessera"},
    "redis": {"url": "rediss://:pw@cache.example.internal:6380/1",
              "brokerUrl": "rediss://:pw@cache.example.internal:6380/0"},
    "s3": {"endpointUrl": "", "bucket": "acme-adapters", "region": "eu-west-1", "prefix": "prod/",
           "accessKeyId": "AKIAEXAMPLE", "secretAccessKey": "secret-example"},
    "secrets": {"engineSecret": "engine-secret", "adminToken": "admin-token"},
    "settings": {"TESSERA_BILLING_CURRENCY": "EUR"},
}
EXISTING_SECRET = {"secrets": {"existingSecret": "tessera-prod-settings"}}
CPU_ONLY = {"engine": {"gpu": False, "replicas": 3, "tolerations": []}}
WITH_SERVICE_MONITOR = {"metrics": {"serviceMonitor": {"enabled": True}}}
WITH_INFERENCE_POOL = {"inferencePool": {"enabled": True, "endpointPicker": {"serviceName": "tessera-epp"}}}
VARIANTS = {"defaults": {}, "external": EXTERNAL, "existing-secret": EXISTING_SECRET, "cpu-only": CPU_ONLY,
            "service-monitor": WITH_SERVICE_MONITOR, "inference-pool": WITH_INFERENCE_POOL}
# The InferencePool CRD of the Gateway API Inference Extension's latest release (its header names
# the source): kubernetes-validate knows only the built-in kinds.
INFERENCE_POOL_CRD = REPO / "tests" / "infra" / "crds" / "inference.networking.k8s.io_inferencepools.yaml"


def render(values: dict) -> list[dict]:
    """The chart's manifests for `values` (as `helm template` with them), parsed."""
    helm = require_helm()
    with helm.Chart.load(str(CHART)) as chart:
        rendered = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [doc for path, text in sorted(rendered.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


@functools.cache
def rendered(variant: str) -> tuple[dict, ...]:
    return tuple(render(VARIANTS[variant]))


def one(docs, kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def containers(docs):
    """(workload name, container) for every container of every workload."""
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet", "Job"):
            for c in d["spec"]["template"]["spec"]["containers"]:
                yield d["metadata"]["name"], c


def settings_env(docs, container: dict, existing_secret: dict | None = None) -> dict[str, str]:
    """The environment a container starts with: its envFrom ConfigMap and Secret, then env."""
    env = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(one(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
        else:
            name = source["secretRef"]["name"]
            secrets = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == name]
            env.update(secrets[0]["stringData"] if secrets else (existing_secret or {}))
    env.update({e["name"]: e["value"] for e in container.get("env", [])})
    return env


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_helm_lint_finds_nothing_above_info(variant):
    helm = require_helm()
    report = helm.lint(str(CHART), VARIANTS[variant], strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    # Helm's severities: 1 info (e.g. "icon is recommended"), 2 warning, 3 error.
    assert [m for m in report["messages"] if m["severity"] > 1] == []


@pytest.mark.parametrize("variant", ["defaults", "external", "existing-secret", "cpu-only"])
def test_every_manifest_passes_the_kubernetes_schemas(variant):
    kubernetes_validate = require_kubernetes_validate()
    for version in (OLDEST_KUBERNETES, kubernetes_validate.latest_version() + ".0"):
        for doc in rendered(variant):
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} on Kubernetes {version}: "
                            f"{e.message} at {list(e.path)}")


def test_the_service_monitor_is_behind_its_flag_and_selects_both_metrics_services():
    """The gateways are scraped on their metrics port through a headless Service of its own (the
    tenant-facing Service does not expose it), the engines on their port."""
    assert not [d for d in rendered("defaults") if d["kind"] == "ServiceMonitor"]
    docs = rendered("service-monitor")
    (monitor,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    selected = []
    for service in (d for d in docs if d["kind"] == "Service"):
        labels = service["metadata"]["labels"]
        if all(labels.get(e["key"]) in e["values"] for e in monitor["spec"]["selector"]["matchExpressions"]):
            assert endpoint["port"] in [p["name"] for p in service["spec"]["ports"]]
            selected.append(service["metadata"]["name"])
    assert sorted(selected) == ["tessera-engine", "tessera-gateway-metrics"]
    metrics = one(docs, "Service", "tessera-gateway-metrics")["spec"]
    assert metrics["clusterIP"] == "None" and metrics["ports"][0]["targetPort"] == "metrics"
    gateway = one(docs, "Service", "tessera-gateway")["spec"]
    assert [p["targetPort"] for p in gateway["ports"]] == ["http"]  # tenants never reach the metrics port


@pytest.mark.parametrize("variant", ["defaults", "cpu-only"])
def test_every_component_of_the_scale_out_shape_is_rendered(variant):
    docs = rendered(variant)
    gateway = one(docs, "Deployment", "tessera-gateway")
    assert gateway["spec"]["template"]["spec"]["containers"][0]["args"] == ["tessera", "serve"]
    hpa = one(docs, "HorizontalPodAutoscaler", "tessera-gateway")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "tessera-gateway"}
    assert hpa["spec"]["minReplicas"] >= 2
    assert one(docs, "Service", "tessera-gateway")["spec"]["ports"][0]["targetPort"] == "http"
    engine = one(docs, "StatefulSet", "tessera-engine")
    assert engine["spec"]["template"]["spec"]["containers"][0]["args"][:2] == ["tessera", "engine-worker"]
    args = {name: " ".join(c["args"]) for name, c in containers(docs)}
    assert args["tessera-celery-worker"].startswith("celery -A adapter_registry.tasks worker -Q adapter-registry")
    assert args["tessera-celery-billing-worker"].startswith("celery -A tessera.billing.tasks worker -Q billing")
    assert args["tessera-celery-beat"].startswith("celery -A tessera.billing.tasks beat")
    beat = one(docs, "Deployment", "tessera-celery-beat")
    assert beat["spec"]["replicas"] == 1 and beat["spec"]["strategy"]["type"] == "Recreate"
    migrate = one(docs, "Job", "tessera-migrate")
    assert args["tessera-migrate"] == "alembic -c /app/alembic.ini upgrade head"
    assert set(migrate["metadata"]["annotations"]["helm.sh/hook"].split(",")) == {"pre-install", "pre-upgrade"}
    # The settings the migration job reads exist before it: hooks weighted earlier.
    for kind in ("ConfigMap", "Secret"):
        settings = one(docs, kind, "tessera-settings")["metadata"]["annotations"]
        assert int(settings["helm.sh/hook-weight"]) < int(migrate["metadata"]["annotations"]["helm.sh/hook-weight"])
    assert "NOTES.txt" in {p.name for p in (CHART / "templates").iterdir()}


@pytest.mark.parametrize("variant", ["defaults", "cpu-only"])
def test_disruption_budgets_select_the_gateways_and_the_engines(variant):
    docs = rendered(variant)
    for name, workload_kind in (("tessera-gateway", "Deployment"), ("tessera-engine", "StatefulSet")):
        pdb = one(docs, "PodDisruptionBudget", name)
        pod_labels = one(docs, workload_kind, name)["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert one(docs, "PodDisruptionBudget", "tessera-gateway")["spec"]["minAvailable"] >= 1
    assert one(docs, "PodDisruptionBudget", "tessera-engine")["spec"]["maxUnavailable"] == 1


def test_each_engine_replica_requests_exactly_one_gpu():
    engine = one(rendered("defaults"), "StatefulSet", "tessera-engine")
    assert engine["spec"]["replicas"] == 2
    (container,) = engine["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {"name": "TESSERA_ENGINE_DEVICE", "value": "cuda"} in container["env"]
    # Nothing else asks for a GPU.
    for name, c in containers(rendered("defaults")):
        if name != "tessera-engine":
            assert "nvidia.com/gpu" not in json.dumps(c.get("resources", {})), name


def test_cpu_engines_request_no_gpu():
    docs = rendered("cpu-only")
    engine = one(docs, "StatefulSet", "tessera-engine")
    assert engine["spec"]["replicas"] == 3
    (container,) = engine["spec"]["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in json.dumps(container["resources"])
    assert {"name": "TESSERA_ENGINE_DEVICE", "value": "cpu"} in container["env"]


@pytest.mark.parametrize("variant", ["defaults", "cpu-only"])
def test_gateways_list_every_engine_replica_by_its_stable_name(variant):
    docs = rendered(variant)
    engine = one(docs, "StatefulSet", "tessera-engine")
    headless = one(docs, "Service", engine["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"].items() <= engine["spec"]["template"]["metadata"]["labels"].items()
    args = engine["spec"]["template"]["spec"]["containers"][0]["args"]
    port = int(args[args.index("--port") + 1])
    assert args[args.index("--host") + 1] == "0.0.0.0"
    urls = json.loads(one(docs, "ConfigMap", "tessera-settings")["data"]["TESSERA_ENGINE_URLS"])
    # StatefulSet pod i is <name>-i, resolvable as <pod>.<headless service>.<namespace>.svc.
    assert [urlparse(u).netloc for u in urls] == [
        f"{engine['metadata']['name']}-{i}.{headless['metadata']['name']}.{NAMESPACE}.svc:{port}"
        for i in range(engine["spec"]["replicas"])]


@pytest.mark.parametrize("variant", ["defaults", "external", "existing-secret", "cpu-only"])
def test_every_variable_is_a_real_setting_and_the_settings_validate(variant):
    from tessera.settings import PlatformSettings

    docs = rendered(variant)
    # What an operator's own Secret holds (secrets.existingSecret), as values.yaml documents it.
    their_secret = {"TESSERA_DATABASE_URL": "postgresql+psycopg2://t:pw@db:5432/t", "TESSERA_REDIS_URL": "redis://r:6379/1",
                    "TESSERA_CELERY_BROKER_URL": "redis://r:6379/0", "TESSERA_ENGINE_SECRET": "s",
                    "TESSERA_ADMIN_TOKEN": "t"}
    known = known_env_vars()
    for name, container in containers(docs):
        env = settings_env(docs, container, their_secret)
        assert sorted(k for k in env if k not in known) == [], name
        fields = {k.removeprefix("TESSERA_").lower(): v for k, v in env.items()}
        fields["engine_urls"] = json.loads(fields["engine_urls"])
        settings = PlatformSettings(**{k: v for k, v in fields.items() if k in PlatformSettings.model_fields})
        assert settings.database_url.startswith("postgresql+psycopg2://"), name
        assert settings.object_store == "s3" and not settings.celery_eager and settings.redis_url, name


def test_external_postgres_redis_and_s3_reach_every_component():
    docs = rendered("external")
    secret = one(docs, "Secret", "tessera-settings")["stringData"]
    config = one(docs, "ConfigMap", "tessera-settings")["data"]
    assert secret["TESSERA_DATABASE_URL"] == EXTERNAL["database"]["url"]
    assert secret["TESSERA_REDIS_URL"] == EXTERNAL["redis"]["url"]
    assert secret["TESSERA_CELERY_BROKER_URL"] == EXTERNAL["redis"]["brokerUrl"]
    assert secret["TESSERA_S3_ACCESS_KEY_ID"] == "AKIAEXAMPLE"
    assert secret["TESSERA_ENGINE_SECRET"] == "engine-secret" and secret["TESSERA_ADMIN_TOKEN"] == "admin-token"
    # No endpoint: AWS S3 itself (an empty TESSERA_S3_ENDPOINT_URL would be a broken URL).
    assert "TESSERA_S3_ENDPOINT_URL" not in config
    assert (config["TESSERA_S3_BUCKET"], config["TESSERA_S3_REGION"], config["TESSERA_S3_PREFIX"]) == (
        "acme-adapters", "eu-west-1", "prod/")
    assert config["TESSERA_BILLING_CURRENCY"] == "EUR"
    for name, container in containers(docs):
        refs = {next(iter(s.values()))["name"] for s in container["envFrom"]}
        assert refs == {"tessera-settings"}, name


def test_an_existing_secret_replaces_the_charts_own():
    docs = rendered("existing-secret")
    assert not [d for d in docs if d["kind"] == "Secret"]
    for name, container in containers(docs):
        secret_refs = [s["secretRef"]["name"] for s in container["envFrom"] if "secretRef" in s]
        assert secret_refs == ["tessera-prod-settings"], name


def test_generated_secrets_are_shared_by_gateways_and_engines():
    secret = one(rendered("defaults"), "Secret", "tessera-settings")["stringData"]
    assert len(secret["TESSERA_ENGINE_SECRET"]) >= 32 and len(secret["TESSERA_ADMIN_TOKEN"]) >= 32


def test_probes_hit_the_real_endpoints_on_the_served_ports():
    from tessera.api.probes import router as gateway_routes
    from tessera.engine_client.worker import router as worker_routes

    docs = rendered("defaults")
    config = one(docs, "ConfigMap", "tessera-settings")["data"]
    real = {"tessera-gateway": {r.path for r in gateway_routes.routes},
            "tessera-engine": {r.path for r in worker_routes.routes}}
    for name, container in containers(docs):
        if name not in real:
            continue
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert container["livenessProbe"]["httpGet"]["path"] == "/health"
        assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            get = container[probe]["httpGet"]
            assert get["path"] in real[name], f"{name} {probe} {get['path']}"
            assert get["port"] in ports
        served = int(config["TESSERA_PORT"]) if name == "tessera-gateway" else \
            int(container["args"][container["args"].index("--port") + 1])
        assert ports[container["livenessProbe"]["httpGet"]["port"]] == served, name


def test_scrape_annotations_point_at_the_metrics_port():
    """The gateway's annotation names its metrics port, the one TESSERA_METRICS_PORT serves (its
    tenant port does not serve /metrics in this, the scale-out, form); the engine's its port."""
    docs = rendered("defaults")
    config = one(docs, "ConfigMap", "tessera-settings")["data"]
    for name, kind in (("tessera-gateway", "Deployment"), ("tessera-engine", "StatefulSet")):
        template = one(docs, kind, name)["spec"]["template"]
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
        ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
        expected = int(config["TESSERA_METRICS_PORT"]) if name == "tessera-gateway" else ports["http"]
        assert int(annotations["prometheus.io/port"]) == ports.get("metrics", ports["http"]) == expected


def crd_schema(crd_path, api_version: str) -> dict:
    """The OpenAPI schema of the CRD's served version that `api_version` names, made strict as
    kubernetes-validate is for built-in kinds: an object's fields outside its schema are errors
    (the API server would prune them silently)."""
    crd = yaml.safe_load(crd_path.read_text())
    group, version = api_version.split("/")
    assert crd["spec"]["group"] == group
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]

    def strict(node):
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node:
                node.setdefault("additionalProperties", False)
            for child in node.values():
                strict(child)
        elif isinstance(node, list):
            for child in node:
                strict(child)
        return node

    return strict(served["schema"]["openAPIV3Schema"])


def cel_rules(schema: dict) -> set[str]:
    """Every x-kubernetes-validations rule (CEL, which jsonschema does not run) in `schema`."""
    found = set()
    if isinstance(schema, dict):
        found |= {v["rule"] for v in schema.get("x-kubernetes-validations", [])}
        for child in schema.values():
            found |= cel_rules(child)
    elif isinstance(schema, list):
        for child in schema:
            found |= cel_rules(child)
    return found


def check_inference_pool(pool: dict) -> None:
    """`pool` against the InferencePool CRD: its OpenAPI schema (jsonschema), then its CEL rules,
    each written out here (a rule the CRD gains and this does not check fails the test)."""
    import jsonschema

    schema = crd_schema(INFERENCE_POOL_CRD, pool["apiVersion"])
    assert pool["kind"] == yaml.safe_load(INFERENCE_POOL_CRD.read_text())["spec"]["names"]["kind"]
    jsonschema.Draft7Validator(schema).validate(pool)
    assert cel_rules(schema) == {"self.kind != 'Service' || has(self.port)",
                                 "self.all(p1, self.exists_one(p2, p1.number==p2.number))"}
    ref = pool["spec"].get("endpointPickerRef")
    if ref is not None:
        assert ref.get("kind", "Service") != "Service" or "port" in ref
    numbers = [p["number"] for p in pool["spec"]["targetPorts"]]
    assert len(numbers) == len(set(numbers))


def test_the_inference_pool_is_behind_its_flag_and_selects_exactly_the_engine_pods():
    """The InferencePool an endpoint picker reads: valid for its CRD, its pods the engine
    StatefulSet's and no other workload's, on the port where the workers serve /metrics (the
    picker scrapes targetPorts[0]), naming the picker's Service when one is given."""
    assert not [d for d in rendered("defaults") if d["kind"] == "InferencePool"]
    docs = rendered("inference-pool")
    (pool,) = [d for d in docs if d["kind"] == "InferencePool"]
    check_inference_pool(pool)
    assert pool["metadata"]["name"] == "tessera-engine"
    engine = one(docs, "StatefulSet", "tessera-engine")
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector == engine["spec"]["selector"]["matchLabels"]
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet", "Job"):
            labels = d["spec"]["template"]["metadata"]["labels"]
            assert all(labels.get(k) == v for k, v in selector.items()) == (d is engine), d["metadata"]["name"]
    template = engine["spec"]["template"]
    ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
    assert pool["spec"]["targetPorts"] == [{"number": ports["http"]}]
    assert template["metadata"]["annotations"]["prometheus.io/port"] == str(ports["http"])
    assert pool["spec"]["endpointPickerRef"] == {"kind": "Service", "name": "tessera-epp", "port": {"number": 9002},
                                                 "failureMode": "FailClose"}
    # Without a picker named, the pool is still valid (the reference is optional in v1).
    (bare,) = [d for d in render({"inferencePool": {"enabled": True}}) if d["kind"] == "InferencePool"]
    check_inference_pool(bare)
    assert "endpointPickerRef" not in bare["spec"]


def test_the_crd_check_refuses_what_the_api_server_would():
    """The InferencePool check is not vacuous: what the CRD refuses, it refuses."""
    import jsonschema

    (pool,) = [d for d in rendered("inference-pool") if d["kind"] == "InferencePool"]
    broken = [
        {**pool, "spec": {**pool["spec"], "targetPorts": []}},  # minItems 1
        {**pool, "spec": {**pool["spec"], "selector": {"matchLabels": {"app": "x" * 64}}}},  # label value too long
        {**pool, "spec": {**pool["spec"], "targetPort": 8100}},  # a misspelt field
        {**pool, "spec": {**pool["spec"],  # not a failure mode
                          "endpointPickerRef": {"name": "epp", "port": {"number": 9002}, "failureMode": "Maybe"}}},
    ]
    for doc in broken:
        with pytest.raises((jsonschema.ValidationError, AssertionError)):
            check_inference_pool(doc)
    with pytest.raises(AssertionError):  # the CEL rule: a Service reference needs its port
        check_inference_pool({**pool, "spec": {**pool["spec"], "endpointPickerRef": {"name": "epp"}}})


@pytest.mark.parametrize("values, message", [
    ({"s3": {"accessKeyId": "AKIA", "secretAccessKey": ""}}, r"set both s3\.accessKeyId and s3\.secretAccessKey"),
    ({"database": {"url": ""}}, r"database\.url \(a postgresql\+psycopg2:// URL\) is required"),
    # values.schema.json: a misspelt key, a value out of range, a setting that is not TESSERA_*.
    ({"gatway": {"replicas": 3}}, r"additional properties 'gatway' not allowed"),
    ({"engine": {"replicas": 0}}, r"/engine/replicas': minimum: got 0, want 1"),
    ({"engine": {"maxLoras": 0}}, r"/engine/maxLoras': minimum: got 0, want 1"),
    ({"settings": {"BILLING_CURRENCY": "EUR"}}, r"'BILLING_CURRENCY' does not match pattern '\^TESSERA_"),
    ({"inferencePool": {"endpointPicker": {"failureMode": "Open"}}}, r"/inferencePool/endpointPicker/failureMode"),
])
def test_bad_values_fail_the_render_with_what_to_fix(values, message):
    helm = require_helm()
    with pytest.raises(helm.HelmError, match=message):
        render(values)
