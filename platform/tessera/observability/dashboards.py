"""The Grafana dashboard for one tenant's traffic and SLOs (`tessera slo dashboard` writes it to
infra/grafana/tessera-tenant-slo.json).

Variables: `datasource` (any Prometheus) and `tenant` (from the tenant label). Rows: latency
(TTFT, TPOT and end-to-end p50/p95/p99), traffic (requests by status, tokens/s), errors and quota
refusals, and the SLOs (burn rate per window against the alert thresholds, error budget left).
The queries read the series of metrics.py and the recording rules of rules.py.
"""
from __future__ import annotations

import json
from pathlib import Path

from tessera.observability.rules import BUDGET_REMAINING, BURN_RATE

DASHBOARD_FILE = "tessera-tenant-slo.json"
UID = "tessera-tenant-slo"
_DS = {"type": "prometheus", "uid": "${datasource}"}
T = 'tenant="$tenant"'


def _target(expr: str, legend: str, ref: str) -> dict:
    return {"datasource": _DS, "expr": expr, "legendFormat": legend, "refId": ref}


def _panel(pid: int, title: str, targets: list[tuple[str, str]], *, x: int, y: int, w: int = 8, h: int = 8,
           unit: str = "short", kind: str = "timeseries", thresholds: list | None = None) -> dict:
    panel = {
        "id": pid, "type": kind, "title": title, "datasource": _DS,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "targets": [_target(e, leg, chr(ord("A") + i)) for i, (e, leg) in enumerate(targets)],
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {},
    }
    if thresholds:
        panel["fieldConfig"]["defaults"]["thresholds"] = {"mode": "absolute", "steps": thresholds}
    return panel


def _quantiles(metric: str) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{T}}}[5m])))", f"p{int(q * 100)}")
            for q in (0.5, 0.95, 0.99)]


def dashboard() -> dict:
    """The dashboard model (Grafana's JSON, schemaVersion 39)."""
    panels = [
        _panel(1, "Time to first token", _quantiles("tessera_request_ttft_seconds"), x=0, y=0, unit="s"),
        _panel(2, "Time per output token", _quantiles("tessera_request_tpot_seconds"), x=8, y=0, unit="s"),
        _panel(3, "End-to-end latency", _quantiles("tessera_request_duration_seconds"), x=16, y=0, unit="s"),
        _panel(4, "Requests by status", [
            (f"sum by (status) (rate(tessera_requests_total{{{T}}}[5m]))", "{{status}}")], x=0, y=8, unit="reqps"),
        _panel(5, "Tokens per second", [
            (f"sum(rate(tessera_prompt_tokens_total{{{T}}}[5m]))", "prompt"),
            (f"sum(rate(tessera_completion_tokens_total{{{T}}}[5m]))", "completion")], x=8, y=8),
        _panel(6, "Errors and quota refusals", [
            (f'sum(rate(tessera_requests_total{{{T},status="error"}}[5m]))', "server errors"),
            (f"sum by (reason) (rate(tessera_quota_refusals_total{{{T}}}[5m]))", "429 {{reason}}")],
            x=16, y=8, unit="reqps"),
        _panel(7, "Burn rate per SLO and window", [
            (f"{BURN_RATE}{w}{{{T}}}", "{{slo}} " + w) for w in ("5m", "1h", "6h", "1d")],
            x=0, y=16, w=12, thresholds=[{"color": "green", "value": None}, {"color": "orange", "value": 1},
                                         {"color": "red", "value": 14.4}]),
        _panel(8, "Error budget remaining (30 days)", [(f"{BUDGET_REMAINING}{{{T}}}", "{{slo}}")],
               x=12, y=16, w=12, unit="percentunit", kind="stat",
               thresholds=[{"color": "red", "value": None}, {"color": "orange", "value": 0.25},
                           {"color": "green", "value": 0.5}]),
    ]
    return {
        "uid": UID, "title": "Tessera tenant SLO", "tags": ["tessera", "slo"], "timezone": "utc",
        "schemaVersion": 39, "version": 1, "editable": True, "refresh": "1m",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
            {"name": "tenant", "type": "query", "datasource": _DS, "label": "Tenant", "refresh": 2,
             "query": {"query": "label_values(tessera_requests_total, tenant)", "refId": "tenants"},
             "definition": "label_values(tessera_requests_total, tenant)", "sort": 1},
        ]},
        "annotations": {"list": [{"name": "Burn-rate alerts", "datasource": _DS, "enable": True,
                                  "expr": f'ALERTS{{alertname="TesseraErrorBudgetBurn",{T},alertstate="firing"}}',
                                  "iconColor": "red", "titleFormat": "{{severity}} {{slo}} {{long_window}}"}]},
        "panels": panels,
    }


def write(out_dir: Path) -> Path:
    """Write the dashboard JSON under `out_dir`; returns its path."""
    path = Path(out_dir) / DASHBOARD_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dashboard(), indent=2) + "\n")
    return path
