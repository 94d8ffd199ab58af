"""`tessera slo rules|dashboard|status`: Prometheus rules, the Grafana dashboard and SLO status.

  tessera slo rules [--out infra/prometheus] [--objectives FILE.json] [--interval 1m] [--check]
      writes <out>/rules/tessera-slo.rules.yml for every live tenant's objectives (read from the
      database of the TESSERA_* settings), or for the tenants of a JSON file
      {"tenants": {name: {field: value}}}; --check runs `promtool check rules` on it.
  tessera slo dashboard [--out infra/grafana]
      writes <out>/tessera-tenant-slo.json (a per-tenant dashboard with a tenant variable).
  tessera slo status TENANT
      prints the tenant's SLO status from its usage events (JSON).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("slo", help="SLO alerting: Prometheus rules, Grafana dashboard, status")
    cmds = p.add_subparsers(dest="slo_command", required=True)

    r = cmds.add_parser("rules", help="write recording rules and burn-rate alerts for every tenant")
    r.add_argument("--out", default="infra/prometheus", help="output folder (default: infra/prometheus)")
    r.add_argument("--objectives", default=None, help="JSON file of tenants' objectives instead of the database")
    r.add_argument("--check", action="store_true", help="run `promtool check rules` on the result")
    r.add_argument("--interval", default=None, help="evaluation interval of every group (default: 1m, 5m for the 30-day budget)")
    r.set_defaults(func=_rules)

    d = cmds.add_parser("dashboard", help="write the per-tenant Grafana dashboard JSON")
    d.add_argument("--out", default="infra/grafana", help="output folder (default: infra/grafana)")
    d.set_defaults(func=_dashboard)

    s = cmds.add_parser("status", help="print a tenant's SLO status computed from its usage events")
    s.add_argument("tenant", help="tenant name")
    s.set_defaults(func=_status)


def _session_factory():
    from tessera.commands.context import platform_context

    return platform_context("slo_objectives").session_factory


def _rules(args: argparse.Namespace) -> int:
    from tessera.cli import CLIError
    from tessera.observability import rules, slo

    if args.objectives:
        try:
            objectives = rules.objectives_from_file(Path(args.objectives))
        except (OSError, ValueError) as e:
            raise CLIError(f"cannot read objectives from {args.objectives}: {e}") from None
    else:
        with _session_factory()() as session:
            objectives = {t.tenant: t.objectives for t in slo.all_objectives(session=session)}
    path = rules.write(objectives, Path(args.out), interval=args.interval)
    print(f"wrote {path} ({len(objectives)} tenants)")
    if args.check:
        promtool = shutil.which("promtool")
        if promtool is None:
            raise CLIError("promtool not found; install Debian's prometheus package (make setup does)")
        done = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
        sys.stdout.write(done.stdout)
        if done.returncode != 0:
            raise CLIError(f"promtool check rules failed: {done.stderr.strip() or done.stdout.strip()}")
    return 0


def _dashboard(args: argparse.Namespace) -> int:
    from tessera.observability import dashboards

    path = dashboards.write(Path(args.out))
    print(f"wrote {path}")
    return 0


def _status(args: argparse.Namespace) -> int:
    from adapter_registry import services as registry
    from adapter_registry.errors import NotFound
    from tessera.cli import CLIError
    from tessera.observability import slo

    with _session_factory()() as session:
        try:
            tenant = registry.get_tenant(session=session, name=args.tenant)
        except NotFound as e:
            raise CLIError(str(e)) from None
        t = slo.objectives_for(session=session, tenant=tenant)
        status = slo.status_from_usage(session=session, tenant_id=t.tenant_id, objectives=t.objectives)
    burn = {name: s["burn_rates"] for name, s in status.items()}
    print(json.dumps({"tenant": t.tenant, "plan": t.plan, "objectives": t.objectives.as_api(),
                      "status": status, "alerts": slo.firing(burn)}, indent=2))
    return 0
