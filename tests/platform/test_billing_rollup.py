"""Billing rollups, invoices and their exactness, on SQLite and on the real Postgres."""
from __future__ import annotations

import random
import threading
from datetime import date, datetime, timedelta, timezone

import pytest
from sqlalchemy import func, select

from adapter_registry.errors import Conflict
from tessera.billing.invoices import close_due, close_period, round_picos
from tessera.billing.models import Invoice, LineItem
from tessera.billing.periods import Period
from tessera.billing.rollup import rollup
from tessera.models import Plan, TenantPolicy, UsageEvent

from .billing_helpers import Ev, PriceList, add_tenant, make_context, write_events

UTC = timezone.utc
PRIOS = ("realtime", "standard", "batch")


@pytest.fixture(params=["sqlite", "postgres"])
def ctx(request, tmp_path):
    c, cleanup = make_context(request.param, tmp_path)
    yield c
    cleanup()


def snapshot(ctx):
    """Every line item and invoice, as plain tuples (to compare runs)."""
    with ctx.session_factory() as s:
        items = sorted((i.tenant_id, str(i.usage_day), i.base_model, i.adapter, i.priority, i.requests, i.input_tokens,
                        i.output_tokens, i.input_price, i.output_price, i.amount_picos, i.invoice_id)
                       for i in s.scalars(select(LineItem)))
        invoices = sorted((i.tenant_id, str(i.period_start), i.subtotal_micros, i.total_micros, i.line_items)
                          for i in s.scalars(select(Invoice)))
    return items, invoices


def line_item_total(ctx, **where) -> int:
    with ctx.session_factory() as s:
        q = select(func.coalesce(func.sum(LineItem.amount_picos), 0))
        for k, v in where.items():
            q = q.where(getattr(LineItem, k) == v)
        return int(s.scalar(q))


def random_prices(ctx, rng, tenants) -> PriceList:
    prices = PriceList()
    for prio in PRIOS:
        for kind in ("input", "output"):
            prices.set(ctx, priority=prio, kind=kind, micros=rng.randrange(1, 5_000_000), eff=date(2026, 1, 1))
            # A book change on a boundary day: events either side get different prices.
            prices.set(ctx, priority=prio, kind=kind, micros=rng.randrange(1, 5_000_000), eff=date(2026, 10, 15))
    # Contract prices for one tenant, one of them starting before the book's change.
    prices.set(ctx, priority="standard", kind="output", micros=123_457, eff=date(2026, 9, 1), tenant_id=tenants[0])
    prices.set(ctx, priority="batch", kind="input", micros=7, eff=date(2026, 10, 31), tenant_id=tenants[0])
    return prices


def random_events(rng, tenants, n) -> list[Ev]:
    out = []
    month_edges = [datetime(2026, 10, 1, tzinfo=UTC), datetime(2026, 11, 1, tzinfo=UTC), datetime(2026, 10, 15, tzinfo=UTC)]
    for _ in range(n):
        if rng.random() < 0.15:  # right at a period or price boundary (either side, to the microsecond)
            at = rng.choice(month_edges) + timedelta(microseconds=rng.choice([-1, 0, 1]))
        else:
            at = datetime(2026, 9, 20, tzinfo=UTC) + timedelta(seconds=rng.randrange(0, 55 * 86400))
        out.append(Ev(tenant_id=rng.choice(tenants), at=at, prompt=rng.randrange(0, 4000), completion=rng.randrange(0, 1500),
                      priority=rng.choice(PRIOS), adapter=rng.choice([None, "sql-bot", "pirate", "pirate@2"])))
    return out


def test_line_items_equal_events_times_prices_to_the_picounit(ctx):
    rng = random.Random(7)
    tenants = [add_tenant(ctx).id for _ in range(4)]
    prices = random_prices(ctx, rng, tenants)
    events = random_events(rng, tenants, 3000)
    # Events arrive in three batches with rollups between; one rollup runs twice.
    write_events(ctx, events[:1000])
    rollup(ctx.engine)
    rollup(ctx.engine)
    write_events(ctx, events[1000:2500])
    rollup(ctx.engine)
    write_events(ctx, events[2500:])
    report = rollup(ctx.engine)
    assert report.events == 500 and report.held == []

    expected = sum(prices.amount(e) for e in events)
    assert line_item_total(ctx) == expected
    for t in tenants:  # and per tenant
        assert line_item_total(ctx, tenant_id=t) == sum(prices.amount(e) for e in events if e.tenant_id == t)
    with ctx.session_factory() as s:  # every event billed exactly once, tokens add up
        assert s.scalar(select(func.count()).where(UsageEvent.billing_run_id.is_(None))) == 0
        assert s.scalar(select(func.sum(LineItem.input_tokens))) == sum(e.prompt for e in events)
        assert s.scalar(select(func.sum(LineItem.requests))) == len(events)
        # Adapters are billed by name, whichever version the request named.
        names = set(s.scalars(select(LineItem.adapter).distinct()))
    assert names == {"", "sql-bot", "pirate"}

    before = snapshot(ctx)
    assert rollup(ctx.engine).events == 0
    assert snapshot(ctx) == before  # a re-run changes nothing

    # Close both months; invoices split the total exactly by month, and re-closing changes nothing.
    now = datetime(2026, 12, 5, tzinfo=UTC)
    invoices = close_due(ctx.engine, currency="USD", now=now)
    assert len(invoices) == 3 * len(tenants)  # Sep, Oct, Nov for every tenant
    for t in tenants:
        for p in (Period.parse("2026-09"), Period.parse("2026-10"), Period.parse("2026-11")):
            own = [e for e in events if e.tenant_id == t and Period.of(e.at) == p]
            inv = close_period(ctx.engine, tenant_id=t, period=p, currency="USD", now=now)
            exact = sum(prices.amount(e) for e in own)
            assert inv.total_micros == inv.subtotal_micros == round_picos(exact)
            assert line_item_total(ctx, invoice_id=inv.id) == exact
            assert inv.input_tokens == sum(e.prompt for e in own) and inv.requests == len(own)
    after_close = snapshot(ctx)
    assert close_due(ctx.engine, currency="USD", now=now) == [] or snapshot(ctx) == after_close
    rollup(ctx.engine)
    assert snapshot(ctx) == after_close


def test_concurrent_rollups_while_events_arrive_bill_each_event_once(ctx):
    rng = random.Random(11)
    tenants = [add_tenant(ctx).id for _ in range(3)]
    prices = random_prices(ctx, rng, tenants)
    events = random_events(rng, tenants, 4000)
    errors = []

    def writer():
        for i in range(0, len(events), 200):
            write_events(ctx, events[i:i + 200])

    def roller():
        try:
            for _ in range(6):
                rollup(ctx.engine)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=roller) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rollup(ctx.engine)
    assert errors == []
    assert line_item_total(ctx) == sum(prices.amount(e) for e in events)
    with ctx.session_factory() as s:
        assert s.scalar(select(func.sum(LineItem.requests))) == len(events)


def test_a_late_event_lands_on_the_next_invoice_with_its_real_day(ctx):
    t = add_tenant(ctx).id
    prices = PriceList()
    for kind, micros in (("input", 1_000_000), ("output", 2_000_000)):
        prices.set(ctx, priority="standard", kind=kind, micros=micros, eff=date(2026, 1, 1))
    write_events(ctx, [Ev(t, datetime(2026, 10, 3, 12, tzinfo=UTC), 1000, 500)])
    rollup(ctx.engine)
    now = datetime(2026, 12, 2, tzinfo=UTC)
    october = close_period(ctx.engine, tenant_id=t, period=Period.parse("2026-10"), currency="USD", now=now)
    assert october.total_micros == 2000  # 1000 tokens at 1 USD/M + 500 at 2 USD/M = 2000 micro-USD
    late = Ev(t, datetime(2026, 10, 30, 23, 59, 59, tzinfo=UTC), 3000, 0)
    write_events(ctx, [late, Ev(t, datetime(2026, 11, 2, tzinfo=UTC), 0, 1000)])
    rollup(ctx.engine)
    # October's invoice is final; the late event waits for the next close.
    assert close_period(ctx.engine, tenant_id=t, period=Period.parse("2026-10"), currency="USD", now=now).total_micros == 2000
    november = close_period(ctx.engine, tenant_id=t, period=Period.parse("2026-11"), currency="USD",
                            now=datetime(2026, 12, 3, tzinfo=UTC))
    assert november.total_micros == 3000 + 2000
    with ctx.session_factory() as s:
        days = sorted(str(i.usage_day) for i in s.scalars(select(LineItem).where(LineItem.invoice_id == november.id)))
    assert days == ["2026-10-30", "2026-11-02"]

    # Late again, and no usage after it: the beat's close_due invoices it with the next month
    # (December, which has no usage of its own), never leaving it pending forever.
    write_events(ctx, [Ev(t, datetime(2026, 11, 20, tzinfo=UTC), 0, 10)])  # (before the real now: rollups stop at now)
    rollup(ctx.engine)
    closed = close_due(ctx.engine, currency="USD", now=datetime(2027, 1, 2, tzinfo=UTC))
    assert [(str(i.period_start), i.total_micros) for i in closed] == [("2026-12-01", 20)]
    assert close_due(ctx.engine, currency="USD", now=datetime(2027, 1, 2, tzinfo=UTC)) == []


def test_usage_without_a_price_is_held_then_billed_when_a_price_exists(ctx):
    t = add_tenant(ctx).id
    prices = PriceList()
    prices.set(ctx, priority="standard", kind="input", micros=1_000_000, eff=date(2026, 1, 1))
    prices.set(ctx, priority="standard", kind="output", micros=1_000_000, eff=date(2026, 1, 1))
    write_events(ctx, [Ev(t, datetime(2026, 10, 3, tzinfo=UTC), 100, 100),
                       Ev(t, datetime(2026, 10, 4, tzinfo=UTC), 5000, 7000, priority="realtime")])
    report = rollup(ctx.engine)
    held = {(h.priority, h.token_kind): h.tokens for h in report.held}
    assert held == {("realtime", "input"): 5000, ("realtime", "output"): 7000}
    now = datetime(2026, 12, 2, tzinfo=UTC)
    inv = close_period(ctx.engine, tenant_id=t, period=Period.parse("2026-10"), currency="USD", now=now)
    assert inv.total_micros == 200 and inv.requests == 1  # realtime not billed at zero: left out
    assert {(h["priority"], h["token_kind"], h["tokens"]) for h in inv.held} == {
        ("realtime", "input", 5000), ("realtime", "output", 7000)}
    prices.set(ctx, priority="realtime", kind="input", micros=3_000_000, eff=date(2026, 10, 1))
    prices.set(ctx, priority="realtime", kind="output", micros=4_000_000, eff=date(2026, 10, 1))
    assert rollup(ctx.engine).held == []
    nov = close_period(ctx.engine, tenant_id=t, period=Period.parse("2026-11"), currency="USD", now=now)
    assert nov.total_micros == 5000 * 3 + 7000 * 4 and nov.held == []


def test_included_tokens_are_credited_first_day_first_and_rounded_once(ctx):
    t = add_tenant(ctx)
    with ctx.session_factory() as s:
        plan = Plan(name="with-allowance", monthly_included_tokens=1500, allowed_priorities=["standard"],
                    default_priority="standard")
        s.add(plan)
        s.flush()
        s.add(TenantPolicy(tenant_id=t.id, plan_id=plan.id))
        s.commit()
    prices = PriceList()
    prices.set(ctx, priority="standard", kind="input", micros=333_333, eff=date(2026, 1, 1))
    prices.set(ctx, priority="standard", kind="output", micros=1_000_001, eff=date(2026, 1, 1))
    # Day 1: 1000 in + 1000 out; day 2: 1000 in. The allowance (1500) takes day 1's input and
    # 500 of its output.
    write_events(ctx, [Ev(t.id, datetime(2026, 10, 1, 5, tzinfo=UTC), 1000, 1000),
                       Ev(t.id, datetime(2026, 10, 2, 5, tzinfo=UTC), 1000, 0)])
    rollup(ctx.engine)
    inv = close_period(ctx.engine, tenant_id=t.id, period=Period.parse("2026-10"), currency="USD",
                       now=datetime(2026, 11, 2, tzinfo=UTC))
    subtotal = 2000 * 333_333 + 1000 * 1_000_001
    credit = 1000 * 333_333 + 500 * 1_000_001
    assert inv.allowance_tokens == 1500 and inv.allowance_used_tokens == 1500
    assert inv.subtotal_micros == round_picos(subtotal) == 1667
    assert inv.total_micros == round_picos(subtotal - credit) == 833  # 833.3335 micro-units
    assert inv.subtotal_micros - inv.allowance_credit_micros == inv.total_micros


def test_closing_refuses_an_open_period_and_an_empty_period_gives_a_zero_invoice(ctx):
    t = add_tenant(ctx).id
    with pytest.raises(Conflict, match="has not ended"):
        close_period(ctx.engine, tenant_id=t, period=Period.parse("2026-11"), currency="USD",
                     now=datetime(2026, 11, 30, 23, tzinfo=UTC))
    with pytest.raises(Conflict, match="can be closed from 2026-12-01T01:00:00Z"):
        close_period(ctx.engine, tenant_id=t, period=Period.parse("2026-11"), currency="USD",
                     now=datetime(2026, 12, 1, 0, 30, tzinfo=UTC), grace=timedelta(hours=1))
    inv = close_period(ctx.engine, tenant_id=t, period=Period.parse("2026-08"), currency="USD",
                       now=datetime(2026, 11, 1, tzinfo=UTC))
    assert (inv.line_items, inv.total_micros, inv.held) == (0, 0, [])


def test_exports_are_reproducible_byte_for_byte(ctx, tmp_path):
    from tessera.billing.exports import build_export
    from adapter_registry.models import Tenant

    rng = random.Random(5)
    tenants = [add_tenant(ctx).id for _ in range(2)]
    random_prices(ctx, rng, tenants)
    write_events(ctx, random_events(rng, tenants, 2000))
    rollup(ctx.engine)
    close_period(ctx.engine, tenant_id=tenants[0], period=Period.parse("2026-10"), currency="USD",
                 now=datetime(2026, 12, 1, 2, tzinfo=UTC))

    def build_all(tag):
        out = {}
        with ctx.session_factory() as s:
            for tid in tenants:
                tenant = s.get(Tenant, tid)
                for p in ("2026-10", "2026-11"):
                    for fmt in ("csv", "parquet", "jsonl"):
                        d = tmp_path / f"{tag}-{tid}-{p}-{fmt}"
                        d.mkdir()
                        built = build_export(s, tenant=tenant, period=Period.parse(p), fmt=fmt, currency="USD", out_dir=d)
                        out[(tid, p, fmt)] = (built.path.read_bytes(), built.rows, built.final)
        return out

    first = build_all("a")
    assert all(rows > 0 for _, rows, _ in first.values())
    assert first[(tenants[0], "2026-10", "csv")][2] is True and first[(tenants[1], "2026-10", "csv")][2] is False
    # New usage elsewhere (another tenant's month) and a re-run of the rollup change none of these files.
    other = add_tenant(ctx).id
    write_events(ctx, [Ev(other, datetime(2026, 10, 5, tzinfo=UTC), 10, 10)])
    rollup(ctx.engine)
    assert build_all("b") == first
