"""Prometheus recording rules and multi-window, multi-burn-rate alerts for every tenant's SLOs.

`generate(objectives)` returns the rule file (a dict; `render` makes the YAML) for
{tenant name: Objectives}. What it records, each with labels {tenant, slo}:

  tessera:slo_errors:ratio_rate<w>          bad / all requests over window w (5m ... 3d, 30d)
      availability: status="error" share of tessera_requests_total (one rule for all tenants)
      ttft, tpot:   1 - (rate of the threshold's histogram bucket / rate of the count); one rule
                    per tenant, because each tenant has its own threshold (its `le` bucket)
  tessera:slo_error_budget:ratio            1 - target (a constant per tenant and SLO)
  tessera:slo_burn_rate:rate<w>             errors ratio / error budget (1 = budget gone in 30 days)
  tessera:slo_error_budget_remaining:ratio  1 - 30-day errors ratio / budget (< 0: overspent)

and one alert, TesseraErrorBudgetBurn, in four rules (slo_definitions.BURN_ALERTS, the SRE workbook pairs
for a 30-day SLO): severity "page" when the burn rate exceeds 14.4 over 1h and 5m, or 6 over 6h
and 30m; "ticket" when it exceeds 3 over 1d and 2h, or 1 over 3d and 6h. The short window makes
an alert stop soon after the burn stops. Each alert carries tenant, slo, severity, long_window
and short_window labels (Alertmanager routes on tenant and severity).

Tenants without generated rules get no SLO series: run `tessera slo rules` again after adding
tenants or changing objectives, then reload Prometheus (SIGHUP or POST /-/reload).
"""
from __future__ import annotations

import json
from pathlib import Path

import yaml
from prometheus_client.utils import floatToGoString

from tessera.observability.metrics import TPOT_BUCKETS_S, TTFT_BUCKETS_S
from tessera.observability.slo_definitions import (
    ALERT_NAME,
    BUDGET,
    BUDGET_REMAINING,
    BURN_ALERTS,
    BURN_RATE,
    DEFAULTS,
    ERROR_RATIO,
    FIELDS,
    WINDOWS,
    Objectives,
    check_values,
)

RULES_FILE = "rules/tessera-slo.rules.yml"

_HISTOGRAMS = {"ttft": ("tessera_request_ttft_seconds", TTFT_BUCKETS_S),
               "tpot": ("tessera_request_tpot_seconds", TPOT_BUCKETS_S)}


def _q(s: str) -> str:
    """A PromQL string literal."""
    return json.dumps(s)


def le_label(slo: str, threshold_ms: int) -> str:
    """The `le` label value of the histogram bucket whose bound is `threshold_ms`, as
    prometheus-client writes it (e.g. 1000 -> "1.0", 75 -> "0.075")."""
    _, buckets = _HISTOGRAMS[slo]
    for b in buckets:
        if int(round(b * 1000)) == threshold_ms:
            return floatToGoString(b)
    raise ValueError(f"{slo} threshold {threshold_ms} ms is not a histogram bucket bound")


def _availability(window: str) -> dict:
    errors = f'sum by (tenant) (rate(tessera_requests_total{{status="error"}}[{window}]))'
    total = f"sum by (tenant) (rate(tessera_requests_total[{window}]))"
    # A tenant with no error series still gets a ratio of 0 (the `or ... * 0` branch).
    return {"record": f"{ERROR_RATIO}{window}", "expr": f"({errors} or {total} * 0)\n/\n{total}",
            "labels": {"slo": "availability"}}


def _latency(slo: str, tenant: str, threshold_ms: int, window: str) -> dict:
    metric, _ = _HISTOGRAMS[slo]
    t = _q(tenant)
    good = f'sum(rate({metric}_bucket{{tenant={t},le="{le_label(slo, threshold_ms)}"}}[{window}]))'
    total = f"sum(rate({metric}_count{{tenant={t}}}[{window}]))"
    return {"record": f"{ERROR_RATIO}{window}", "expr": f"1 - ({good}\n/\n{total})",
            "labels": {"tenant": tenant, "slo": slo}}


def _alert(a) -> dict:
    cond = (f"{BURN_RATE}{a.long_window} > {a.factor:g}\n"
            f"and\n{BURN_RATE}{a.short_window} > {a.factor:g}")
    what = "fast" if a.severity == "page" else "slowly"
    return {
        "alert": ALERT_NAME,
        "expr": cond,
        "labels": {"severity": a.severity, "long_window": a.long_window, "short_window": a.short_window},
        "annotations": {
            "summary": (f"Tenant {{{{ $labels.tenant }}}} is burning its {{{{ $labels.slo }}}} error budget {what}: "
                        f"over {a.factor:g}x in both {a.long_window} and {a.short_window}"),
        },
    }


def generate(objectives: dict[str, Objectives], *, interval: str | None = None) -> dict:
    """The rule file for {tenant name: objectives} (tenants in name order). Groups evaluate every
    minute (the 30-day budget group every 5 minutes) unless `interval` sets one for all."""
    sli, budgets = [], []
    for w in WINDOWS:
        sli.append(_availability(w))
    for tenant in sorted(objectives):
        o = objectives[tenant]
        for slo in ("ttft", "tpot"):
            for w in WINDOWS:
                sli.append(_latency(slo, tenant, o.threshold_ms(slo), w))
        for slo in ("availability", "ttft", "tpot"):
            budgets.append({"record": BUDGET, "expr": f"vector({1.0 - o.target(slo):.6g})",
                            "labels": {"tenant": tenant, "slo": slo}})
    burn = [{"record": f"{BURN_RATE}{w}", "expr": f"{ERROR_RATIO}{w}\n/ on (tenant, slo)\n{BUDGET}"}
            for w in WINDOWS]
    month = [_availability("30d")]
    for tenant in sorted(objectives):
        for slo in ("ttft", "tpot"):
            month.append(_latency(slo, tenant, objectives[tenant].threshold_ms(slo), "30d"))
    month.append({"record": BUDGET_REMAINING, "expr": f"1 - {ERROR_RATIO}30d\n/ on (tenant, slo)\n{BUDGET}"})
    return {"groups": [
        {"name": "tessera-slo", "interval": interval or "1m", "rules": sli + budgets + burn},
        {"name": "tessera-slo-budget", "interval": interval or "5m", "rules": month},
        {"name": "tessera-slo-alerts", "interval": interval or "1m", "rules": [_alert(a) for a in BURN_ALERTS]},
    ]}


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper, s: str):
    # Multi-line PromQL as a block scalar: readable in review and in Prometheus' UI.
    return dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)


_Dumper.add_representer(str, _str)

HEADER = ("# Generated by `tessera slo rules` (tessera/observability/rules.py) from the tenants' SLO\n"
          "# objectives; do not edit by hand, regenerate after changing tenants or objectives.\n")


def render(objectives: dict[str, Objectives], *, interval: str | None = None) -> str:
    """The rule file as YAML text."""
    return HEADER + yaml.dump(generate(objectives, interval=interval), Dumper=_Dumper, sort_keys=False, width=120)


def write(objectives: dict[str, Objectives], out_dir: Path, *, interval: str | None = None) -> Path:
    """Write the rule file under `out_dir` (RULES_FILE); returns its path."""
    path = Path(out_dir) / RULES_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(objectives, interval=interval))
    return path


def objectives_from_file(path: Path) -> dict[str, Objectives]:
    """{tenant: Objectives} from a JSON file {"tenants": {name: {field: value, ...}}}; missing
    fields take the built-in defaults. ValueError with the tenant and field for a bad value."""
    data = json.loads(Path(path).read_text())
    out = {}
    for tenant, values in (data.get("tenants") or {}).items():
        try:
            check_values(values)
        except ValueError as e:
            raise ValueError(f"tenant {tenant!r}: {e}") from None
        out[tenant] = Objectives(**{f: values.get(f, getattr(DEFAULTS, f)) for f in FIELDS})
    return out
