"""Billing rollup throughput: N usage events in Postgres rolled up into priced line items.

Creates a scratch Postgres database (dropped at the end), migrates it, inserts N usage events
(server-side, generate_series: 200 tenants, 5 adapters + the base model, 3 priority classes,
spread over September and October 2026) and a price book, then times `tessera.billing.rollup.rollup` over all
of them (one transaction: mark + sum + price). The peer, in the same run, is the obvious
per-event loop (read each event, look its price up in Python, upsert its line item) on a sample.
Checks that the line items sum to the events' tokens x prices exactly. Prints one JSON object.

    .venv/bin/python bench/billing.py [--events 1000000] [--peer-events 20000] [--pg postgresql+psycopg2://postgres@127.0.0.1:5432/postgres]
"""
from __future__ import annotations

import argparse
import json
import os
import platform as pyplatform
import sys
import time
import uuid
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "platform"))
sys.path.insert(0, str(ROOT))

from sqlalchemy import create_engine, text  # noqa: E402

from adapter_registry.migrate import upgrade  # noqa: E402
from adapter_registry.settings import RegistrySettings  # noqa: E402
from tessera.billing.prices import PriceBook, set_price  # noqa: E402
from tessera.billing.rollup import rollup  # noqa: E402
from tessera_core.context import build_context  # noqa: E402

TENANTS = 200
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
PRICES = {("realtime", "input"): 400_000, ("realtime", "output"): 1_600_000,
          ("standard", "input"): 150_000, ("standard", "output"): 600_000,
          ("batch", "input"): 75_000, ("batch", "output"): 300_000}


def insert_events(db, n: int, prefix: str) -> None:
    """n events, deterministic pseudo-random fields, created over Sep-Oct 2026."""
    with db.begin() as conn:
        conn.execute(text("""
            INSERT INTO usage_events (request_id, tenant_id, api_key_id, model, base_model, adapter_version,
                                      priority, prompt_tokens, completion_tokens, status, finish_reason,
                                      ttft_ms, duration_ms, created_at)
            SELECT :prefix || g, (g % :tenants) + 1, NULL,
                   CASE WHEN g % 6 = 0 THEN :model ELSE 'adapter-' || (g % 5) END, :model,
                   CASE WHEN g % 6 = 0 THEN NULL ELSE md5((g % 5)::text) END,
                   (ARRAY['realtime','standard','batch'])[(g % 3) + 1],
                   (g * 7919) % 2000 + 1, (g * 104729) % 500, 'completed', 'stop', 50.0, 900.0,
                   timestamptz '2026-09-01 00:00:00+00' + ((g * 5237) % (61 * 86400)) * interval '1 second'
            FROM generate_series(1::bigint, :n) AS g"""), {"prefix": prefix, "tenants": TENANTS, "model": MODEL, "n": n})


def per_event_peer(db, session_factory, n: int) -> float:
    """The naive way, for scale: one SELECT of each event's fields, a Python price lookup, one
    upsert per event into a scratch table. Returns events/s."""
    with db.begin() as conn:
        conn.execute(text("CREATE TEMP TABLE IF NOT EXISTS peer_items (tenant_id int, day date, adapter text, "
                          "priority text, input bigint, output bigint, amount bigint, "
                          "PRIMARY KEY (tenant_id, day, adapter, priority))"))
    books: dict[int, PriceBook] = {}
    with session_factory() as s:
        t0 = time.perf_counter()
        rows = s.execute(text("SELECT tenant_id, (created_at AT TIME ZONE 'UTC')::date, model, priority, "
                              "prompt_tokens, completion_tokens FROM usage_events WHERE request_id LIKE 'peer-%'")).all()
        for tenant, day, model, prio, p, c in rows:
            book = books.get(tenant) or books.setdefault(tenant, PriceBook(s, tenant))
            amount = p * book.price(MODEL, prio, "input", day) + c * book.price(MODEL, prio, "output", day)
            s.execute(text("INSERT INTO peer_items VALUES (:t, :d, :a, :p, :i, :o, :m) ON CONFLICT "
                           "(tenant_id, day, adapter, priority) DO UPDATE SET input = peer_items.input + excluded.input, "
                           "output = peer_items.output + excluded.output, amount = peer_items.amount + excluded.amount"),
                      {"t": tenant, "d": day, "a": model, "p": prio, "i": p, "o": c, "m": amount})
        s.commit()
        return len(rows) / (time.perf_counter() - t0)


def _cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return pyplatform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--peer-events", type=int, default=20_000)
    ap.add_argument("--pg", default="postgresql+psycopg2://postgres@127.0.0.1:5432/postgres")
    args = ap.parse_args()

    name = f"tessera_bench_{uuid.uuid4().hex[:10]}"
    admin = create_engine(args.pg, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))
        pg_version = c.execute(text("SHOW server_version")).scalar()
    url = args.pg.rsplit("/", 1)[0] + "/" + name
    try:
        settings = RegistrySettings(database_url=url)
        upgrade(settings)
        ctx = build_context(settings)
        with ctx.engine.begin() as conn:
            conn.execute(text("INSERT INTO tenants (id, name, status, created_at, updated_at) "
                              "SELECT g, 'tenant-' || g, 'active', now(), now() FROM generate_series(1, :n) g"),
                         {"n": TENANTS})
        with ctx.session_factory() as s:
            for (prio, kind), micros in PRICES.items():
                set_price(session=s, base_model=MODEL, priority=prio, token_kind=kind, micros_per_mtok=micros,
                          effective_from=date(2026, 1, 1))
            # A contract price for tenant 1 from November on.
            set_price(session=s, base_model=MODEL, priority="standard", token_kind="output", micros_per_mtok=500_000,
                      effective_from=date(2026, 11, 1), tenant_id=1)
        t0 = time.perf_counter()
        insert_events(ctx.engine, args.events, "req-")
        insert_s = time.perf_counter() - t0
        with ctx.engine.begin() as conn:
            conn.execute(text("ANALYZE usage_events"))

        t0 = time.perf_counter()
        report = rollup(ctx.engine)
        rollup_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        again = rollup(ctx.engine)
        rerun_s = time.perf_counter() - t0

        with ctx.engine.connect() as conn:
            items, item_sum = conn.execute(text("SELECT count(*), sum(amount_picos) FROM billing_line_items")).one()
            event_sum = conn.execute(text("""
                SELECT sum(e.prompt_tokens::numeric * pi.micros_per_mtok + e.completion_tokens::numeric * po.micros_per_mtok)
                FROM usage_events e
                CROSS JOIN LATERAL (SELECT micros_per_mtok FROM billing_prices p WHERE p.token_kind = 'input'
                    AND p.priority = e.priority AND p.base_model = e.base_model
                    AND p.effective_from <= (e.created_at AT TIME ZONE 'UTC')::date
                    AND (p.tenant_id IS NULL OR p.tenant_id = e.tenant_id)
                    ORDER BY (p.tenant_id IS NULL), p.effective_from DESC LIMIT 1) pi
                CROSS JOIN LATERAL (SELECT micros_per_mtok FROM billing_prices p WHERE p.token_kind = 'output'
                    AND p.priority = e.priority AND p.base_model = e.base_model
                    AND p.effective_from <= (e.created_at AT TIME ZONE 'UTC')::date
                    AND (p.tenant_id IS NULL OR p.tenant_id = e.tenant_id)
                    ORDER BY (p.tenant_id IS NULL), p.effective_from DESC LIMIT 1) po""")).scalar()

        insert_events(ctx.engine, args.peer_events, "peer-")
        peer = per_event_peer(ctx.engine, ctx.session_factory, args.peer_events)
        ctx.engine.dispose()
    finally:
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))

    print(json.dumps({
        "bench": "billing_rollup", "events": report.events, "line_items": items,
        "rollup_s": round(rollup_s, 3), "rollup_events_per_s": round(report.events / rollup_s),
        "rerun_events": again.events, "rerun_s": round(rerun_s, 3),
        "per_event_loop_events_per_s": round(peer), "speedup_vs_per_event_loop": round(report.events / rollup_s / peer, 1),
        "exact": int(item_sum) == int(event_sum), "amount_picos": int(item_sum),
        "insert_s": round(insert_s, 2), "postgres": pg_version,
        "machine": {"cpu": _cpu_name(), "cores": os.cpu_count(), "python": pyplatform.python_version()},
    }))


if __name__ == "__main__":
    main()
