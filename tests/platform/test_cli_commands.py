"""The README's `tessera billing` and `tessera slo` commands, each run as an operator runs it: a
fresh process on a migrated SQLite database and a local object store named by TESSERA_* settings,
its output read back and checked against usage written beforehand. (`billing list|download` and
`slo rules --check|status` have further subprocess tests in test_billing_api.py and
test_slo_rules.py; `generate` is in test_cli_generate.py, `adapters` in
tests/adapter_registry/test_registry_cli.py.)"""
from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from .billing_helpers import BASE, Ev, add_tenant, make_context, write_events

MONTH = "2026-10"  # an ended month (the tests run later than that): it can be closed
# Book prices per million tokens, in micro-units: 1 and 2 units per million.
INPUT_MICROS, OUTPUT_MICROS = 1_000_000, 2_000_000
EVENTS = [(1000, 500), (2000, 250), (3000, 1250)]  # (prompt, completion) tokens
INPUT_TOKENS = sum(p for p, _ in EVENTS)
OUTPUT_TOKENS = sum(c for _, c in EVENTS)
# micro-units per 1M tokens x tokens / 1M = micro-units; here exact integers.
TOTAL_MICROS = (INPUT_TOKENS * INPUT_MICROS + OUTPUT_TOKENS * OUTPUT_MICROS) // 1_000_000


@pytest.fixture
def workspace(tmp_path):
    """A migrated SQLite database and object store with one tenant's usage in MONTH; returns
    (context, tenant name, the environment a `tessera` process reads them from)."""
    ctx, cleanup = make_context("sqlite", tmp_path)
    tenant = add_tenant(ctx)
    write_events(ctx, [Ev(tenant.id, datetime(2026, 10, 3 + i, 12, tzinfo=timezone.utc), p, c)
                       for i, (p, c) in enumerate(EVENTS)])
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")} | {
        "TESSERA_DATABASE_URL": ctx.settings.database_url,
        "TESSERA_OBJECT_STORE_ROOT": str(ctx.settings.object_store_root)}
    yield ctx, tenant.name, env
    cleanup()


def tessera(env: dict, cwd: Path, *args: str) -> str:
    """Run `tessera ARGS` in a fresh process; assert it exits 0; return its stdout."""
    r = subprocess.run([sys.executable, "-m", "tessera.cli", *args], env=env, cwd=cwd, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, (args, r.stderr)
    assert "Traceback" not in r.stderr
    return r.stdout


def test_billing_price_rollup_periods_close_export_list_download(workspace, tmp_path):
    _, name, env = workspace
    run = lambda *a: tessera(env, tmp_path, *a)  # noqa: E731

    for kind, micros in (("input", INPUT_MICROS), ("output", OUTPUT_MICROS)):
        price = json.loads(run("billing", "price", BASE, "standard", kind, str(micros), "--from", "2026-01-01"))
        assert (price["base_model"], price["priority"], price["token_kind"], price["micros_per_mtok"],
                price["effective_from"], price["tenant"]) == (BASE, "standard", kind, micros, "2026-01-01", None)

    rolled = json.loads(run("billing", "rollup"))
    assert rolled["events"] == len(EVENTS) and rolled["held"] == []

    periods = json.loads(run("billing", "periods", name))
    assert periods["tenant"] == name
    assert periods["periods"] == [{"period": MONTH, "status": "open", "total_micros": None,
                                   "pending_micros": TOTAL_MICROS, "held_tokens": 0}]

    invoice = json.loads(run("billing", "close", name, MONTH))
    assert (invoice["tenant"], invoice["period"], invoice["subtotal_micros"], invoice["total_micros"]) == (
        name, MONTH, TOTAL_MICROS, TOTAL_MICROS)
    assert invoice["line_items"] >= 1 and invoice["held"] == []
    closed = json.loads(run("billing", "periods", name))["periods"]
    assert [(p["period"], p["status"], p["total_micros"]) for p in closed] == [(MONTH, "closed", TOTAL_MICROS)]

    exports, files = {}, {}
    for fmt in ("csv", "parquet", "jsonl"):
        out = tmp_path / f"export.{fmt}"
        meta = json.loads(run("billing", "export", name, MONTH, "--format", fmt, "-o", str(out)))
        assert (meta["tenant"], meta["period"], meta["format"], meta["final"]) == (name, MONTH, fmt, True)
        assert meta["size_bytes"] == out.stat().st_size > 0
        exports[fmt], files[fmt] = meta, out.read_bytes()
    rows = list(csv.DictReader(io.StringIO(files["csv"].decode())))
    assert sum(int(r["amount_picos"]) for r in rows) == TOTAL_MICROS * 1_000_000
    assert sum(int(r["input_tokens"]) for r in rows) == INPUT_TOKENS
    assert sum(int(r["output_tokens"]) for r in rows) == OUTPUT_TOKENS
    table = pq.read_table(io.BytesIO(files["parquet"]))
    assert sum(table.column("amount_picos").to_pylist()) == TOTAL_MICROS * 1_000_000
    events = [json.loads(line) for line in files["jsonl"].decode().splitlines()]
    assert len(events) == len(EVENTS) and all(e["subject"] == name for e in events)
    assert sorted((e["data"]["input_tokens"], e["data"]["output_tokens"]) for e in events) == sorted(EVENTS)

    listed = json.loads(run("billing", "list", name, "--period", MONTH))["exports"]
    assert {e["format"]: e["id"] for e in listed} == {fmt: m["id"] for fmt, m in exports.items()}
    for fmt, meta in exports.items():
        got = tmp_path / f"downloaded.{fmt}"
        run("billing", "download", str(meta["id"]), "-o", str(got))
        assert got.read_bytes() == files[fmt]


def test_slo_rules_dashboard_and_status(workspace, tmp_path):
    ctx, name, env = workspace
    recent = datetime.now(timezone.utc) - timedelta(hours=2)
    write_events(ctx, [Ev(ctx_tenant_id(ctx, name), recent, 10, 5) for _ in range(4)])
    run = lambda *a: tessera(env, tmp_path, *a)  # noqa: E731

    out = run("slo", "rules", "--out", str(tmp_path / "prometheus"))
    assert out.startswith("wrote ") and "(1 tenants)" in out
    rules_file = Path(out.split()[1])
    assert rules_file.is_file() and f'tenant="{name}"' in rules_file.read_text()

    out = run("slo", "dashboard", "--out", str(tmp_path / "grafana"))
    dash_file = Path(out.split()[1])
    dashboard = json.loads(dash_file.read_text())
    assert dashboard["panels"] and "tenant" in {v["name"] for v in dashboard["templating"]["list"]}

    # The four recent requests (the October ones are outside the 30-day window), all good.
    status = json.loads(run("slo", "status", name))
    assert status["tenant"] == name and status["alerts"] == []
    assert set(status["status"]) == {"availability", "ttft", "tpot"}
    for name_, s in status["status"].items():
        assert (s["requests_30d"], s["bad_30d"], s["error_budget_remaining"]) == (4, 0, 1.0), name_
        assert s["target"] == status["objectives"][name_]["target"]


def ctx_tenant_id(ctx, name: str) -> int:
    from sqlalchemy import select

    from adapter_registry.models import Tenant

    with ctx.session_factory() as s:
        return s.scalar(select(Tenant.id).where(Tenant.name == name))
