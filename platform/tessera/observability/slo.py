"""Per-tenant SLO objectives (stored in slo_objectives) and their status: burn rates per window,
error budget remaining and the burn-rate alerts that fire.

Three SLOs per tenant, each over a 30-day window:
  availability  share of requests not failed by the platform (status "error", a 5xx)
  ttft          share of requests whose time to first token is <= ttft_threshold_ms
  tpot          share of requests (2+ output tokens) whose time per output token is <= tpot_threshold_ms

Objectives resolve field by field: the tenant's own row, else its plan's row, else DEFAULTS.
Thresholds must be bucket bounds of the gateway's histograms (metrics.py), so Prometheus reads
the good-event count straight from the threshold's bucket.

Burn rate over a window = (bad / total in the window) / (1 - target): 1.0 spends the budget in
exactly 30 days. Alerts (the SRE workbook's multi-window, multi-burn-rate pairs, BURN_ALERTS) fire
when both the long and the short window burn faster than the pair's factor. The status comes from
Prometheus (the recording rules rules.py writes) when `prometheus_url` is set, else from the
usage_events table with the same definitions.

The definitions themselves (SLO names, windows, BURN_ALERTS, Objectives, DEFAULTS, the recorded
series' names) live in slo_definitions.py, which rules.py imports too; this module keeps them
importable as slo.Objectives, slo.DEFAULTS, slo.BURN_ALERTS for its callers.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone

from sqlalchemy import and_, case, func, select
from sqlalchemy.orm import Session

from tessera.models import Plan, TenantPolicy, UsageEvent
from tessera.observability.models import SloObjective
from tessera.observability.slo_definitions import (
    ALERT_NAME,
    BUDGET_REMAINING,
    BURN_ALERTS,
    BURN_RATE,
    DEFAULTS,
    ERROR_RATIO,
    FIELDS,
    SLO_NAMES,
    WINDOW_SECONDS,
    WINDOWS,
    BurnAlert,
    Objectives,
    check_values,
)


def _row_values(row: SloObjective | None) -> dict:
    return {f: (getattr(row, f) if row is not None else None) for f in FIELDS}


def _resolve(tenant_row: SloObjective | None, plan_row: SloObjective | None) -> Objectives:
    t, p = _row_values(tenant_row), _row_values(plan_row)
    return Objectives(**{f: t[f] if t[f] is not None else p[f] if p[f] is not None else getattr(DEFAULTS, f)
                         for f in FIELDS})


def _plan_of(session: Session, tenant_id: int) -> Plan | None:
    return session.scalar(select(Plan).join(TenantPolicy, TenantPolicy.plan_id == Plan.id)
                          .where(TenantPolicy.tenant_id == tenant_id))


@dataclass(frozen=True)
class TenantObjectives:
    """A tenant's effective objectives, its own overrides (None = inherited) and plan name."""

    tenant_id: int
    tenant: str
    plan: str | None
    objectives: Objectives
    overrides: dict


def objectives_for(*, session: Session, tenant) -> TenantObjectives:
    """The effective objectives of `tenant` (a registry Tenant row)."""
    plan = _plan_of(session, tenant.id)
    own = session.scalar(select(SloObjective).where(SloObjective.tenant_id == tenant.id))
    plan_row = session.scalar(select(SloObjective).where(SloObjective.plan_id == plan.id)) if plan else None
    return TenantObjectives(tenant.id, tenant.name, plan.name if plan else None, _resolve(own, plan_row),
                            _row_values(own))


def all_objectives(*, session: Session) -> list[TenantObjectives]:
    """Every live tenant's effective objectives, by tenant name (what the rule generator writes)."""
    from adapter_registry.models import Tenant

    tenants = session.scalars(select(Tenant).where(Tenant.deleted_at.is_(None)).order_by(Tenant.name))
    return [objectives_for(session=session, tenant=t) for t in tenants]


def _upsert(session: Session, row: SloObjective | None, owner: dict, values: dict) -> SloObjective:
    check_values(values)
    if row is None:
        row = SloObjective(**owner)
        session.add(row)
    for k, v in values.items():
        setattr(row, k, v)
    session.commit()
    return row


def set_tenant_objectives(*, session: Session, tenant, values: dict) -> TenantObjectives:
    """Override the tenant's objectives with `values` (a None value goes back to the plan's); commits."""
    row = session.scalar(select(SloObjective).where(SloObjective.tenant_id == tenant.id))
    _upsert(session, row, {"tenant_id": tenant.id}, values)
    return objectives_for(session=session, tenant=tenant)


def plan_objectives(*, session: Session, plan: Plan) -> tuple[Objectives, dict]:
    """The plan's effective objectives (its row over DEFAULTS) and its own values (None = default)."""
    row = session.scalar(select(SloObjective).where(SloObjective.plan_id == plan.id))
    return _resolve(None, row), _row_values(row)


def set_plan_objectives(*, session: Session, plan: Plan, values: dict) -> tuple[Objectives, dict]:
    """Set the objectives of every tenant on `plan` that does not override them; commits."""
    row = session.scalar(select(SloObjective).where(SloObjective.plan_id == plan.id))
    _upsert(session, row, {"plan_id": plan.id}, values)
    return plan_objectives(session=session, plan=plan)


# ------------------------------------------------------------------ status


def firing(burn_rates: dict[str, dict[str, float | None]]) -> list[dict]:
    """The burn-rate alerts that fire for burn rates {slo: {window: rate or None}}."""
    out = []
    for slo in SLO_NAMES:
        rates = burn_rates.get(slo, {})
        for a in BURN_ALERTS:
            long, short = rates.get(a.long_window), rates.get(a.short_window)
            if long is not None and short is not None and long > a.factor and short > a.factor:
                out.append(alert_dict(slo, a, "firing"))
    return out


def alert_dict(slo: str, a: BurnAlert, state: str) -> dict:
    return {"alert": ALERT_NAME, "slo": slo, "severity": a.severity, "long_window": a.long_window,
            "short_window": a.short_window, "burn_rate_threshold": a.factor, "state": state}


def _slo_status(target: float, threshold_ms: int | None, bad: dict[str, int], total: dict[str, int]) -> dict:
    budget = 1.0 - target

    def burn(w: str) -> float | None:
        return None if not total[w] else (bad[w] / total[w]) / budget

    ratio30 = (bad["30d"] / total["30d"]) if total["30d"] else None
    return {"target": target, "threshold_ms": threshold_ms,
            "requests_30d": total["30d"], "bad_30d": bad["30d"],
            "error_ratio_30d": ratio30,
            "error_budget_remaining": 1.0 if ratio30 is None else 1.0 - ratio30 / budget,
            "burn_rates": {w: burn(w) for w in WINDOWS}}


def status_from_usage(*, session: Session, tenant_id: int, objectives: Objectives,
                      now: datetime | None = None) -> dict:
    """{slo: status} from the tenant's usage events of the last 30 days, in one query. Each status:
    {"target", "threshold_ms", "requests_30d", "bad_30d", "error_ratio_30d",
     "error_budget_remaining" (1 = untouched, 0 = spent, negative = overspent),
     "burn_rates": {window: rate or None when the window has no request}}."""
    now = now or datetime.now(timezone.utc)
    e = UsageEvent
    has_ttft = e.ttft_ms.is_not(None)
    tpot_eligible = and_(has_ttft, e.completion_tokens >= 2)
    kinds = {
        "availability": (None, e.status == "error"),
        "ttft": (has_ttft, and_(has_ttft, e.ttft_ms > objectives.ttft_threshold_ms)),
        "tpot": (tpot_eligible, and_(tpot_eligible, (e.duration_ms - e.ttft_ms)
                                     > objectives.tpot_threshold_ms * (e.completion_tokens - 1))),
    }
    cols, keys = [], []
    for w, seconds in WINDOW_SECONDS.items():
        since = now - timedelta(seconds=seconds)
        in_w = e.created_at >= since
        for slo, (eligible, bad) in kinds.items():
            cond_total = in_w if eligible is None else and_(in_w, eligible)
            cols += [func.coalesce(func.sum(case((cond_total, 1), else_=0)), 0),
                     func.coalesce(func.sum(case((and_(in_w, bad), 1), else_=0)), 0)]
            keys += [(slo, w, "total"), (slo, w, "bad")]
    since30 = now - timedelta(seconds=WINDOW_SECONDS["30d"])
    row = session.execute(select(*cols).where(e.tenant_id == tenant_id, e.created_at >= since30)).one()
    counts = {k: int(v) for k, v in zip(keys, row)}
    return {slo: _slo_status(objectives.target(slo), objectives.threshold_ms(slo),
                             {w: counts[(slo, w, "bad")] for w in WINDOW_SECONDS},
                             {w: counts[(slo, w, "total")] for w in WINDOW_SECONDS})
            for slo in SLO_NAMES}


async def status_from_prometheus(client, url: str, targets: list[TenantObjectives]) -> dict[str, tuple[dict, list[dict]]]:
    """{tenant: ({slo: status}, alerts)} for `targets` from Prometheus, in two requests whatever
    the number of tenants: one query of the recording rules rules.py writes, and the alerts
    Prometheus holds (pending or firing). Counts are None (Prometheus keeps ratios). Raises
    httpx.HTTPError when Prometheus cannot be reached."""
    names = {t.tenant for t in targets}
    tenant_sel = f',tenant="{_escape(next(iter(names)))}"' if len(names) == 1 else ""
    sel = f'{{__name__=~"{BURN_RATE}.*|{BUDGET_REMAINING}|{ERROR_RATIO}30d"{tenant_sel}}}'
    base = url.rstrip("/")
    r = await client.get(f"{base}/api/v1/query", params={"query": sel})
    r.raise_for_status()
    out = {t.tenant: ({slo: {"target": t.objectives.target(slo), "threshold_ms": t.objectives.threshold_ms(slo),
                             "requests_30d": None, "bad_30d": None, "error_ratio_30d": None,
                             "error_budget_remaining": None, "burn_rates": {w: None for w in WINDOWS}}
                       for slo in SLO_NAMES}, [])
           for t in targets}
    for item in r.json()["data"]["result"]:
        labels, value = item["metric"], _num(item["value"][1])
        entry = out.get(labels.get("tenant"))
        s = entry[0].get(labels.get("slo")) if entry else None
        if s is None:
            continue
        name = labels["__name__"]
        if name == BUDGET_REMAINING:
            s["error_budget_remaining"] = value
        elif name == ERROR_RATIO + "30d":
            s["error_ratio_30d"] = value
        elif name.startswith(BURN_RATE) and name[len(BURN_RATE):] in s["burn_rates"]:
            s["burn_rates"][name[len(BURN_RATE):]] = value
    r = await client.get(f"{base}/api/v1/alerts")
    r.raise_for_status()
    for a in r.json()["data"]["alerts"]:
        lab = a["labels"]
        entry = out.get(lab.get("tenant"))
        rule = next((b for b in BURN_ALERTS if b.long_window == lab.get("long_window")), None)
        if entry is None or rule is None or lab.get("alertname") != ALERT_NAME or lab.get("slo") not in SLO_NAMES:
            continue
        entry[1].append(alert_dict(lab["slo"], rule, a.get("state", "firing")))
    return out


def _num(v: str) -> float | None:
    f = float(v)
    return None if f != f else f  # NaN (no traffic in the window) -> None


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"')


def objectives_dict(o: Objectives) -> dict:
    """The flat field -> value form PATCH accepts."""
    return asdict(o)
