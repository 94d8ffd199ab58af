"""`tessera billing ...`: prices, rollups, invoices and exports from the command line (finance's
and operators' tool; it works on the database and object store of the TESSERA_* settings, the
same jobs the Celery worker runs).

  tessera billing price MODEL PRIORITY KIND MICROS_PER_MTOK --from YYYY-MM-DD [--tenant T]
  tessera billing rollup                               bill new usage events now
  tessera billing periods TENANT                       months with usage, open or closed
  tessera billing close TENANT YYYY-MM                 close a month into an invoice
  tessera billing export TENANT YYYY-MM --format csv|parquet|jsonl [-o FILE]
  tessera billing list TENANT [--period YYYY-MM]       exports written so far
  tessera billing download EXPORT_ID [-o FILE]         an export's file (default: its own name)

Output is JSON (one object) except `download`, which writes the file and prints its path.
"""
from __future__ import annotations

import argparse
import json
from datetime import date
from pathlib import Path


class _LazyChoices:
    """argparse `choices`: the tuple `module.name`, imported only when a value is checked or the
    help is shown (registering the CLI's commands stays free of the engine and the database models)."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __iter__(self):
        import importlib

        return iter(getattr(importlib.import_module(self.module), self.name))

    def __contains__(self, value) -> bool:
        return value in tuple(self)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("billing", help="prices, rollups, invoices and exports")
    cmds = p.add_subparsers(dest="billing_command", required=True)

    c = cmds.add_parser("price", help="set a price (micro-units per million tokens) from a day on")
    c.add_argument("base_model")
    c.add_argument("priority", choices=_LazyChoices("engine.sampling_params", "PRIORITY_NAMES"), metavar="priority",
                   help="class: %(choices)s")
    c.add_argument("token_kind", choices=_LazyChoices("tessera.billing.models", "TOKEN_KINDS"), metavar="token_kind",
                   help="%(choices)s (cached_input: prompt tokens the prefix cache served; without a cached_input "
                        "price they are billed at the input price)")
    c.add_argument("micros_per_mtok", type=int)
    c.add_argument("--from", dest="effective_from", required=True, help="first UTC day it applies (YYYY-MM-DD)")
    c.add_argument("--tenant", default=None, help="a contract price of this tenant (default: the book)")
    c.set_defaults(func=_price)

    c = cmds.add_parser("rollup", help="roll new usage events up into priced line items now")
    c.set_defaults(func=_rollup)

    c = cmds.add_parser("periods", help="a tenant's months with usage: open or closed, totals")
    c.add_argument("tenant")
    c.set_defaults(func=_periods)

    c = cmds.add_parser("close", help="roll up, then close a tenant's month into an invoice")
    c.add_argument("tenant")
    c.add_argument("period", help="YYYY-MM")
    c.set_defaults(func=_close)

    c = cmds.add_parser("export", help="write a tenant's month as CSV, Parquet or CloudEvents JSONL to the object store")
    c.add_argument("tenant")
    c.add_argument("period", help="YYYY-MM")
    c.add_argument("--format", required=True, choices=["csv", "parquet", "jsonl"])
    c.add_argument("-o", "--out", default=None, help="also save the file here")
    c.set_defaults(func=_export)

    c = cmds.add_parser("list", help="a tenant's exports")
    c.add_argument("tenant")
    c.add_argument("--period", default=None, help="YYYY-MM")
    c.set_defaults(func=_list)

    c = cmds.add_parser("download", help="save an export's file")
    c.add_argument("export_id", type=int)
    c.add_argument("-o", "--out", default=None, help="file to write (default: the export's name, here)")
    c.set_defaults(func=_download)


def _ctx():
    from tessera.commands.context import platform_context

    return platform_context("billing_line_items")


def _run(fn):
    """fn(ctx) with registry/billing errors turned into one-line CLI errors."""
    from adapter_registry.errors import RegistryError
    from tessera.cli import CLIError

    try:
        return fn(_ctx())
    except (RegistryError, ValueError) as e:
        raise CLIError(str(e)) from None


def _print(obj) -> int:
    print(json.dumps(obj, indent=2, default=str))
    return 0


def _period(name: str):
    from tessera.billing.periods import Period, PeriodError
    from tessera.cli import CLIError

    try:
        return Period.parse(name)
    except PeriodError as e:
        raise CLIError(str(e)) from None


def _tenant(ctx, name):
    from adapter_registry import services as registry

    with ctx.session_factory() as s:
        return registry.get_tenant(session=s, name=name)


def _price(args) -> int:
    from tessera.billing.prices import set_price
    from tessera.cli import CLIError

    try:
        eff = date.fromisoformat(args.effective_from)
    except ValueError:
        raise CLIError(f"--from {args.effective_from!r} is not a day written YYYY-MM-DD") from None

    def run(ctx):
        tid = _tenant(ctx, args.tenant).id if args.tenant else None
        with ctx.session_factory() as s:
            p = set_price(session=s, base_model=args.base_model, priority=args.priority, token_kind=args.token_kind,
                          micros_per_mtok=args.micros_per_mtok, effective_from=eff, tenant_id=tid)
            return {"id": p.id, "tenant": args.tenant, "base_model": p.base_model, "priority": p.priority,
                    "token_kind": p.token_kind, "micros_per_mtok": p.micros_per_mtok,
                    "effective_from": p.effective_from.isoformat()}

    return _print(_run(run))


def _rollup(_args) -> int:
    from tessera.billing import jobs

    return _print(_run(lambda ctx: jobs.rollup_job(ctx).as_dict()))


def _periods(args) -> int:
    from tessera.billing.invoices import list_periods, round_picos

    def run(ctx):
        t = _tenant(ctx, args.tenant)
        with ctx.session_factory() as s:
            out = []
            for p in list_periods(s, tenant_id=t.id):
                inv, pending = p["invoice"], p["pending"]
                out.append({"period": p["period"].name, "status": "closed" if inv else "open",
                            "total_micros": inv.total_micros if inv else None,
                            "pending_micros": round_picos(pending["amount_picos"]) if pending else 0,
                            "held_tokens": pending["held_tokens"] if pending else 0})
            return {"tenant": t.name, "currency": ctx.settings.billing_currency, "periods": out}

    return _print(_run(run))


def _close(args) -> int:
    from tessera.billing import jobs

    period = _period(args.period)

    def run(ctx):
        t = _tenant(ctx, args.tenant)
        i = jobs.close_period_job(ctx, tenant_id=t.id, period=period)
        return {"invoice_id": i.id, "tenant": t.name, "period": period.name, "currency": i.currency,
                "line_items": i.line_items, "subtotal_micros": i.subtotal_micros,
                "allowance_credit_micros": i.allowance_credit_micros, "total_micros": i.total_micros, "held": i.held}

    return _print(_run(run))


def _export_dict(e, tenant: str) -> dict:
    from tessera.billing.exports import download_name
    from tessera.billing.periods import Period

    return {"id": e.id, "tenant": tenant, "period": Period(e.period_start).name, "format": e.format, "rows": e.rows,
            "size_bytes": e.size_bytes, "sha256": e.sha256, "final": e.final, "object_key": e.object_key,
            "filename": download_name(tenant, e.period_start, e.format), "created_at": e.created_at.isoformat()}


def _export(args) -> int:
    from tessera.billing import jobs
    from tessera.billing.exports import fetch_export

    period = _period(args.period)

    def run(ctx):
        t = _tenant(ctx, args.tenant)
        e = jobs.export_job(ctx, tenant_id=t.id, period=period, fmt=args.format)
        if args.out:
            fetch_export(ctx.store, e, Path(args.out))
        return _export_dict(e, t.name)

    return _print(_run(run))


def _list(args) -> int:
    from tessera.billing.exports import list_exports

    period = _period(args.period) if args.period else None

    def run(ctx):
        t = _tenant(ctx, args.tenant)
        with ctx.session_factory() as s:
            return {"tenant": t.name, "exports": [_export_dict(e, t.name)
                                                  for e in list_exports(s, tenant_id=t.id, period=period)]}

    return _print(_run(run))


def _download(args) -> int:
    from adapter_registry.errors import NotFound
    from adapter_registry.models import Tenant
    from tessera.billing.exports import download_name, fetch_export
    from tessera.billing.models import Export

    def run(ctx):
        with ctx.session_factory() as s:
            e = s.get(Export, args.export_id)
            if e is None:
                raise NotFound(f"export {args.export_id} not found; `tessera billing list TENANT` lists them")
            name = s.get(Tenant, e.tenant_id).name
        out = Path(args.out or download_name(name, e.period_start, e.format))
        fetch_export(ctx.store, e, out)
        return out

    print(_run(run))
    return 0
