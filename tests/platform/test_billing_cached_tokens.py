"""Cached prompt tokens in billing: the cached_input token kind on SQLite and the real Postgres
(a tenant with a cached price and one without, whose invoices must not move by a picounit),
exports, included-token credits, migration 0007 over existing data, usage outbox files written
before the field existed, and the public surfaces (admin billing API, /v1/usage, /metrics) on the
running platform."""
from __future__ import annotations

import csv
import io
import json
import uuid
from datetime import date, datetime, timezone

import anyio
import httpx
import pytest
from sqlalchemy import column, func, insert, inspect, select, table, text

from adapter_registry.migrate import downgrade, upgrade
from adapter_registry.settings import RegistrySettings
from tessera import services
from tessera.billing.exports import build_export
from tessera.billing.invoices import close_period, round_picos
from tessera.billing.models import Invoice, LineItem, Price
from tessera.billing.periods import Period
from tessera.billing.prices import set_price
from tessera.billing.rollup import rollup
from tessera.metering import Meter, Usage
from tessera.models import Plan, TenantPolicy, UsageEvent
from tessera.outbox import UsageOutbox, database_tag
from tessera.usage_query import usage_buckets
from tessera_core.db import make_engine, make_session_factory

from ..adapter_registry.conftest import create_pg_database, drop_pg_database
from .billing_helpers import BASE, Ev, PriceList, add_tenant, make_context, write_events

UTC = timezone.utc
OCT = Period.parse("2026-10")
AFTER_OCT = datetime(2026, 11, 5, tzinfo=UTC)
# Odd prices, so that any rounding or mix-up of kinds shows in the picos.
INPUT, CACHED, OUTPUT = 1_234_567, 123_457, 2_345_679


@pytest.fixture(params=["sqlite", "postgres"])
def ctx(request, tmp_path):
    c, cleanup = make_context(request.param, tmp_path)
    yield c
    cleanup()


def book_prices(ctx) -> PriceList:
    """Input and output prices in the book for standard and batch; no cached_input price."""
    prices = PriceList()
    for prio in ("standard", "batch"):
        prices.set(ctx, priority=prio, kind="input", micros=INPUT, eff=date(2026, 1, 1))
        prices.set(ctx, priority=prio, kind="output", micros=OUTPUT, eff=date(2026, 1, 1))
    return prices


def october_events(tenant_id: int) -> list[Ev]:
    """Requests with none, some and all of their prompt cached, on several days and classes."""
    shapes = [(1000, 0, 50), (1000, 640, 50), (4097, 4096, 1), (333, 333, 0), (17, 5, 999), (0, 0, 7)]
    return [Ev(tenant_id, datetime(2026, 10, 1 + i % 28, i % 24, tzinfo=UTC), p, c, cached=k,
               priority="batch" if i % 3 == 0 else "standard")
            for i, (p, k, c) in enumerate(shapes * 5)]


def items_of(ctx, tenant_id: int) -> list[LineItem]:
    with ctx.session_factory() as s:
        return list(s.scalars(select(LineItem).where(LineItem.tenant_id == tenant_id)))


def test_cached_tokens_are_billed_at_the_cached_price_else_exactly_as_before(ctx):
    cached_t, plain_t, twin_t = (add_tenant(ctx).id for _ in range(3))
    prices = book_prices(ctx)
    # One tenant's contract prices cached input; the book has no cached_input price.
    prices.set(ctx, priority="standard", kind="cached_input", micros=CACHED, eff=date(2026, 1, 1), tenant_id=cached_t)
    prices.set(ctx, priority="batch", kind="cached_input", micros=CACHED // 2, eff=date(2026, 1, 1), tenant_id=cached_t)
    cached_ev, plain_ev = october_events(cached_t), october_events(plain_t)
    # The twin has the same requests with nothing cached: what plain_t was billed before the kind existed.
    twin_ev = [Ev(twin_t, e.at, e.prompt, e.completion, priority=e.priority) for e in plain_ev]
    write_events(ctx, cached_ev + plain_ev + twin_ev)
    report = rollup(ctx.engine)
    assert report.held == []

    # Line items: the cached tokens as their own kind, at the price they were billed at.
    for t, evs in ((cached_t, cached_ev), (plain_t, plain_ev)):
        items = items_of(ctx, t)
        assert sum(i.input_tokens for i in items) == sum(e.prompt for e in evs)
        assert sum(i.cached_input_tokens for i in items) == sum(e.cached for e in evs) > 0
        assert sum(i.amount_picos for i in items) == sum(prices.amount(e) for e in evs)
    assert {(i.priority, i.cached_input_price) for i in items_of(ctx, cached_t)} == {
        ("standard", CACHED), ("batch", CACHED // 2)}
    assert all(i.cached_input_price == i.input_price == INPUT for i in items_of(ctx, plain_t))

    invoices = {t: close_period(ctx.engine, tenant_id=t, period=OCT, currency="USD", now=AFTER_OCT)
                for t in (cached_t, plain_t, twin_t)}
    # Without a cached price: the same invoice to the picounit as with nothing cached.
    plain, twin = invoices[plain_t], invoices[twin_t]
    assert (plain.subtotal_micros, plain.total_micros, plain.input_tokens, plain.output_tokens) == (
        twin.subtotal_micros, twin.total_micros, twin.input_tokens, twin.output_tokens)
    assert sorted(i.amount_picos for i in items_of(ctx, plain_t)) == sorted(
        i.amount_picos for i in items_of(ctx, twin_t))
    assert plain.cached_input_tokens == sum(e.cached for e in plain_ev) and twin.cached_input_tokens == 0
    # With one: uncached prompt tokens at the input price, cached ones at the cached price.
    exact = sum((e.prompt - e.cached) * INPUT + e.cached * (CACHED if e.priority == "standard" else CACHED // 2)
                + e.completion * OUTPUT for e in cached_ev)
    assert invoices[cached_t].total_micros == round_picos(exact) < plain.total_micros
    assert invoices[cached_t].cached_input_tokens == sum(e.cached for e in cached_ev)


def test_a_cached_price_from_a_day_on_reprices_pending_items_only(ctx):
    t = add_tenant(ctx).id
    prices = book_prices(ctx)
    sep = Ev(t, datetime(2026, 9, 30, 12, tzinfo=UTC), 1000, 100, cached=800)
    octo = Ev(t, datetime(2026, 10, 20, 12, tzinfo=UTC), 1000, 100, cached=800)
    write_events(ctx, [sep, octo])
    rollup(ctx.engine)
    september = close_period(ctx.engine, tenant_id=t, period=Period.parse("2026-09"), currency="USD", now=AFTER_OCT)
    assert september.total_micros == round_picos(1000 * INPUT + 100 * OUTPUT)
    # The book prices cached input from October 15: the pending October item follows at the next
    # rollup; September's invoice stays what it was.
    prices.set(ctx, priority="standard", kind="cached_input", micros=CACHED, eff=date(2026, 10, 15))
    rollup(ctx.engine)
    october = close_period(ctx.engine, tenant_id=t, period=OCT, currency="USD", now=AFTER_OCT)
    assert october.total_micros == round_picos(200 * INPUT + 800 * CACHED + 100 * OUTPUT)
    assert october.total_micros == round_picos(prices.amount(octo))
    with ctx.session_factory() as s:
        assert s.get(Invoice, september.id).total_micros == september.total_micros
        assert s.scalar(select(LineItem.cached_input_price).where(LineItem.invoice_id == september.id)) == INPUT


def test_included_tokens_are_credited_at_each_kinds_price(ctx):
    t = add_tenant(ctx)
    with ctx.session_factory() as s:
        plan = Plan(name=f"p-{uuid.uuid4().hex[:6]}", monthly_included_tokens=1500)
        s.add(plan)
        s.flush()
        s.add(TenantPolicy(tenant_id=t.id, plan_id=plan.id))
        s.commit()
    book_prices(ctx)
    with ctx.session_factory() as s:
        set_price(session=s, base_model=BASE, priority="standard", token_kind="cached_input", micros_per_mtok=CACHED,
                  effective_from=date(2026, 1, 1), tenant_id=t.id)
    write_events(ctx, [Ev(t.id, datetime(2026, 10, 2, tzinfo=UTC), 1000, 700, cached=600)])
    rollup(ctx.engine)
    inv = close_period(ctx.engine, tenant_id=t.id, period=OCT, currency="USD", now=AFTER_OCT)
    # 1500 included: the 400 uncached input tokens, the 600 cached ones, then 500 of the output.
    subtotal = 400 * INPUT + 600 * CACHED + 700 * OUTPUT
    assert inv.allowance_used_tokens == 1500
    assert inv.total_micros == round_picos(subtotal - (400 * INPUT + 600 * CACHED + 500 * OUTPUT))
    assert inv.subtotal_micros - inv.allowance_credit_micros == inv.total_micros


def test_exports_show_cached_tokens_as_their_own_kind(ctx, tmp_path):
    t = add_tenant(ctx)
    prices = book_prices(ctx)
    prices.set(ctx, priority="batch", kind="cached_input", micros=CACHED, eff=date(2026, 1, 1), tenant_id=t.id)
    events = october_events(t.id)
    write_events(ctx, events)
    rollup(ctx.engine)
    with ctx.session_factory() as s:
        build_export(s, tenant=t, period=OCT, fmt="csv", currency="USD", out_dir=tmp_path)
        build_export(s, tenant=t, period=OCT, fmt="jsonl", currency="USD", out_dir=tmp_path)
    rows = list(csv.DictReader(io.StringIO((tmp_path / "export.csv").read_text())))
    for r in rows:  # every row reconciles: tokens of each kind x its price = the amount
        uncached = int(r["input_tokens"]) - int(r["cached_input_tokens"])
        assert int(r["amount_picos"]) == (uncached * int(r["input_price_micros_per_mtok"])
                                          + int(r["cached_input_tokens"]) * int(r["cached_input_price_micros_per_mtok"])
                                          + int(r["output_tokens"]) * int(r["output_price_micros_per_mtok"]))
    assert {(r["priority"], r["cached_input_price_micros_per_mtok"]) for r in rows} == {
        ("batch", str(CACHED)), ("standard", str(INPUT))}
    assert sum(int(r["cached_input_tokens"]) for r in rows) == sum(e.cached for e in events)
    assert sum(int(r["amount_picos"]) for r in rows) == sum(prices.amount(e) for e in events)
    lines = [json.loads(x)["data"] for x in (tmp_path / "export.jsonl").read_text().splitlines()]
    assert sorted((d["input_tokens"], d["cached_input_tokens"], d["output_tokens"]) for d in lines) == sorted(
        (e.prompt, e.cached, e.completion) for e in events)


def test_the_usage_api_reports_cached_tokens_and_costs_them_as_billing_does(ctx):
    t = add_tenant(ctx).id
    prices = book_prices(ctx)
    prices.set(ctx, priority="standard", kind="cached_input", micros=CACHED, eff=date(2026, 1, 1), tenant_id=t)
    events = october_events(t)
    write_events(ctx, events)
    start = int(datetime(2026, 10, 1, tzinfo=UTC).timestamp())
    with ctx.session_factory() as s:
        page = usage_buckets(session=s, tenant_id=t, start_time=start, end_time=start + 31 * 86400,
                             bucket_width="1d", group_by=["priority"], limit=31)
    results = [(b, r) for b in page["data"] for r in b["results"]]
    assert sum(r["input_tokens"] for _, r in results) == sum(e.prompt for e in events)
    assert sum(r["input_cached_tokens"] for _, r in results) == sum(e.cached for e in events)
    for b, r in results:
        own = [e for e in events if e.priority == r["priority"] and b["start_time"] <= e.at.timestamp() < b["end_time"]]
        assert r["input_cached_tokens"] == sum(e.cached for e in own)
        assert r["unpriced_tokens"] == 0 and r["cost_micros"] == round_picos(sum(prices.amount(e) for e in own))


def test_out_of_range_cached_counts_are_bounded_to_the_prompt():
    def u(prompt, cached):
        return Usage(request_id="r", tenant_id=1, api_key_id=None, model="m", adapter_version=None,
                     priority="standard", prompt_tokens=prompt, completion_tokens=1, status="completed",
                     finish_reason="stop", ttft_ms=1.0, duration_ms=2.0, cached_tokens=cached)

    assert [u(10, c).cached_tokens for c in (-3, 0, 7, 10, 11)] == [0, 0, 7, 10, 10]


@pytest.fixture(params=["sqlite", "postgres"])
def bare_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'm.db'}"
    else:
        url = create_pg_database()
        yield url
        drop_pg_database(url)


def _columns_0006(model, *extra: str):
    """A table clause of `model`'s table with only columns it had at 0006 (the ones written here),
    typed as the model types them (so dates and times are stored as the application stores them)."""
    names = ("tenant_id", "usage_day", "base_model", "adapter", "priority", "requests", "input_tokens",
             "output_tokens", "prompt_tokens", "completion_tokens", "status", *extra)
    cols = model.__table__.c
    return table(model.__tablename__, *(column(n, cols[n].type) for n in names if n in cols))


def test_migration_0007_keeps_existing_usage_and_amounts(bare_url):
    settings = RegistrySettings(database_url=bare_url)
    # The plan and tenant as the services write them (the ORM knows only today's columns), then the
    # schema back at 0006 with their rows kept: what a 0006 gateway had.
    upgrade(settings)
    engine = make_engine(bare_url)
    try:
        with make_session_factory(engine)() as s:
            services.upsert_plan(session=s, name="m")
            tid = services.create_tenant(session=s, name="t-mig", plan="m").id
        engine.dispose()
        downgrade(settings, "0006")
        with make_session_factory(engine)() as s:
            for kind, micros in (("input", INPUT), ("output", OUTPUT)):
                set_price(session=s, base_model=BASE, priority="standard", token_kind=kind, micros_per_mtok=micros,
                          effective_from=date(2026, 1, 1))
        with engine.begin() as conn:  # what a 0006 gateway and rollup left: a priced item, an unbilled event
            conn.execute(insert(_columns_0006(LineItem, "input_price", "output_price", "amount_picos")).values(
                tenant_id=tid, usage_day=date(2026, 10, 2), base_model=BASE, adapter="", priority="standard",
                requests=1, input_tokens=1000, output_tokens=100, input_price=INPUT, output_price=OUTPUT,
                amount_picos=1000 * INPUT + 100 * OUTPUT))
            conn.execute(insert(_columns_0006(UsageEvent, "request_id", "model", "duration_ms", "created_at")).values(
                request_id="old-1", tenant_id=tid, model=BASE, base_model=BASE, priority="standard",
                prompt_tokens=500, completion_tokens=50, status="completed", duration_ms=1.0,
                created_at=datetime(2026, 10, 3, tzinfo=UTC)))
        engine.dispose()

        upgrade(settings)
        with make_session_factory(engine)() as s:
            assert s.get(UsageEvent, "old-1").cached_tokens == 0
            item = s.scalar(select(LineItem))
            assert (item.cached_input_tokens, item.cached_input_price) == (0, INPUT)
        rollup(engine)
        inv = close_period(engine, tenant_id=tid, period=OCT, currency="USD", now=AFTER_OCT)
        assert inv.total_micros == round_picos(1500 * INPUT + 150 * OUTPUT) and inv.cached_input_tokens == 0
        with make_session_factory(engine)() as s:  # the new kind can be priced now
            set_price(session=s, base_model=BASE, priority="standard", token_kind="cached_input",
                      micros_per_mtok=CACHED, effective_from=date(2026, 1, 1))
        engine.dispose()

        downgrade(settings, "0006")  # the kind's prices go with it; the rest stays
        assert "cached_tokens" not in {c["name"] for c in inspect(engine).get_columns("usage_events")}
        with engine.connect() as conn:
            kinds = sorted(conn.execute(text("SELECT token_kind FROM billing_prices")).scalars())
            assert kinds == ["input", "output"]
            assert conn.execute(text("SELECT total_micros FROM billing_invoices")).scalar_one() == inv.total_micros
        engine.dispose()
        upgrade(settings)
        with make_session_factory(engine)() as s:
            assert s.scalar(select(func.count()).select_from(Price)) == 2
    finally:
        engine.dispose()


def test_an_outbox_written_before_cached_tokens_existed_still_drains(tmp_path):
    url = f"sqlite:///{tmp_path / 'tessera.db'}"
    upgrade(RegistrySettings(database_url=url))
    engine = make_engine(url)
    with make_session_factory(engine)() as s:
        services.upsert_plan(session=s, name="o")
        tid = services.create_tenant(session=s, name="t-outbox", plan="o").id
    # A file a gateway of the previous version left behind: events without cached_tokens (and
    # one without base_model, as before billing), then one written after the upgrade.
    old = dict(request_id="old", tenant_id=tid, api_key_id=None, model=BASE, adapter_version=None,
               priority="standard", prompt_tokens=100, completion_tokens=10, status="completed",
               finish_reason="stop", ttft_ms=1.0, duration_ms=2.0, created_at=datetime(2026, 10, 1, tzinfo=UTC))
    outbox_dir = tmp_path / "outbox"
    box = UsageOutbox.create(outbox_dir, database_tag(url))
    box.append({**old, "base_model": BASE})
    box.append({**old, "request_id": "older"})
    box.append({**old, "request_id": "new", "base_model": BASE, "cached_tokens": 64})
    box.close()

    meter = Meter(engine, make_session_factory(engine), outbox_dir=outbox_dir)
    try:
        assert meter.adopt_orphans() == 3
        assert meter.drain_once() == 3 and meter.outbox_depth == 0
    finally:
        meter.close()
    with engine.connect() as conn:
        rows = dict(conn.execute(select(UsageEvent.request_id, UsageEvent.cached_tokens)).all())
    engine.dispose()
    assert rows == {"old": 0, "older": 0, "new": 64}
    assert list(outbox_dir.glob("usage-outbox-*.sqlite")) == []


def test_cached_tokens_through_the_gateway_meter_admin_api_usage_api_and_metrics(platform):
    t = platform.tenant()
    model = platform.gateway.engine.model_name
    for kind, micros in (("input", INPUT), ("cached_input", CACHED), ("output", OUTPUT)):
        r = platform.admin.put("/admin/v1/billing/prices", json={
            "base_model": model, "priority": "standard", "token_kind": kind, "micros_per_mtok": micros,
            "effective_from": "2020-01-01", "tenant": t.name})
        assert r.status_code == 200, r.text
    bad = platform.admin.put("/admin/v1/billing/prices", json={
        "base_model": model, "priority": "standard", "token_kind": "cached", "micros_per_mtok": 1,
        "effective_from": "2020-01-01", "tenant": t.name})
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "token_kind"

    tid = platform.admin.get(f"/admin/v1/tenants/{t.name}").json()["id"]
    shapes = [(900, 768, 20), (900, 0, 30)]  # (prompt, cached, completion): a prefix hit, then a miss
    for prompt, cached, completion in shapes:
        usage = Usage(request_id="c-" + uuid.uuid4().hex, tenant_id=tid, api_key_id=t.key_id, model=model,
                      adapter_version=None, priority="standard", prompt_tokens=prompt, completion_tokens=completion,
                      status="completed", finish_reason="stop", ttft_ms=1.0, duration_ms=2.0, base_model=model,
                      cached_tokens=cached)
        assert anyio.run(platform.gateway.meter.record, usage)
    exact = sum((p - c) * INPUT + c * CACHED + n * OUTPUT for p, c, n in shapes)

    assert platform.admin.post("/admin/v1/billing/rollup").status_code == 200
    month = Period.of(datetime.now(UTC)).name
    detail = platform.admin.get(f"/admin/v1/tenants/{t.name}/billing/periods/{month}").json()
    [li] = detail["line_items"]
    assert (li["input_tokens"], li["cached_input_tokens"], li["cached_input_price_micros_per_mtok"],
            li["amount_picos"]) == (1800, 768, CACHED, exact)
    [period] = platform.admin.get(f"/admin/v1/tenants/{t.name}/billing/periods").json()["data"]
    assert period["pending"]["cached_input_tokens"] == 768

    now = int(datetime.now(UTC).timestamp())
    u = httpx.get(f"{platform.url}/v1/usage", params={"start_time": now - now % 86400, "bucket_width": "1d"},
                  headers={"authorization": f"Bearer {t.key}"}, timeout=60).json()
    [res] = u["data"][0]["results"]
    assert (res["input_tokens"], res["input_cached_tokens"], res["cost_micros"]) == (1800, 768, round_picos(exact))

    metrics = httpx.get(f"{platform.url}/metrics", timeout=30).text
    assert f'tessera_cached_prompt_tokens_total{{tenant="{t.name}"}} 768.0' in metrics
