"""The rollup: usage events -> priced line items, set-based, idempotent, safe to run concurrently.

One rollup, in one transaction:
1. takes the billing lock (a Postgres advisory lock; on SQLite the first write takes the
   database's single write lock), so rollups and period closes run one at a time;
2. marks every event no rollup has taken yet (billing_run_id IS NULL, created_at < cutoff) with
   this run's id and adds their sums, grouped by (tenant, UTC day, base model, adapter,
   priority), into the pending line items (INSERT ... SELECT ... GROUP BY ... ON CONFLICT DO
   UPDATE). On Postgres the mark and the sum are one statement (an UPDATE ... RETURNING feeding
   the INSERT), so an event committed meanwhile is either in both or in neither; on SQLite the
   write lock keeps any event from committing between the two statements;
3. prices every pending line item from the price book (one UPDATE with correlated subqueries):
   a missing price leaves the item's price and amount NULL, so it is held, never billed at zero.
   Cached prompt tokens take the cached_input price, or the input price where there is none
   (so an item's amount with no cached_input price is exactly what it was before the kind).

Because every event is marked exactly once, in the same transaction that sums it, re-running a
rollup adds nothing, and any interleaving of rollups gives the same line items. Events are
never read into Python.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import date, datetime, timezone

from sqlalchemy import Date, and_, case, cast, func, insert, or_, select, text, true, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine

from tessera.billing.models import TOKEN_KINDS, BillingRun, LineItem
from tessera.billing.prices import price_expr
from tessera.models import UsageEvent
from tessera_core.db import utcnow

#: pg_advisory_xact_lock key of billing (rollups and closes take it; any constant works).
BILLING_LOCK_KEY = 0x7E55E7A_B111


def take_billing_lock(conn: Connection) -> None:
    """Serialize billing writers; call it first in the transaction. On Postgres an advisory lock
    held to the end of the transaction. On SQLite a write that changes nothing takes the
    database's write lock now: a transaction that read first and wrote later would fail
    outright (not wait) if another writer committed in between."""
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": BILLING_LOCK_KEY})
    else:
        conn.execute(text("UPDATE billing_runs SET events = events WHERE 0 = 1"))


def usage_day(col, dialect: str):
    """A timestamp column's UTC calendar day, as SQL."""
    if dialect == "postgresql":
        return cast(func.timezone("UTC", col), Date)
    return func.date(col)  # SQLite keeps UTC timestamps as text


def adapter_name(model, adapter_version, dialect: str):
    """The adapter's name ('' for the base model): the requested model up to any '@version'."""
    at = (func.strpos if dialect == "postgresql" else func.instr)(model, "@")
    return case((adapter_version.is_(None), ""),
                (at > 0, func.substr(model, 1, at - 1)),
                else_=model)


@dataclass
class HeldUsage:
    """Pending usage that cannot be billed: no price for (base_model, priority, token_kind)."""

    base_model: str
    priority: str
    token_kind: str
    tenants: int
    line_items: int
    tokens: int


@dataclass
class RollupReport:
    run_id: int
    events: int
    cutoff: datetime
    held: list[HeldUsage] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"run_id": self.run_id, "events": self.events, "cutoff": self.cutoff.isoformat(),
                "held": [h.__dict__ for h in self.held]}


def _insert(dialect: str):
    return postgresql.insert if dialect == "postgresql" else sqlite.insert


def _sum_into_line_items(src, dialect: str):
    """INSERT the grouped sums of `src` (event rows) into pending line items, adding to existing ones."""
    day = usage_day(src.c.created_at, dialect)
    adapter = adapter_name(src.c.model, src.c.adapter_version, dialect)
    base = func.coalesce(src.c.base_model, src.c.model)  # base_model is NULL only in pre-billing events
    keys = [src.c.tenant_id, day, base, adapter, src.c.priority]
    agg = (select(*keys, func.count(), func.sum(src.c.prompt_tokens), func.sum(src.c.cached_tokens),
                  func.sum(src.c.completion_tokens))
           .where(true())  # SQLite: keeps "ON CONFLICT" from parsing as a join constraint
           .group_by(*keys))
    li = LineItem.__table__
    stmt = _insert(dialect)(li).from_select(
        ["tenant_id", "usage_day", "base_model", "adapter", "priority", "requests", "input_tokens",
         "cached_input_tokens", "output_tokens"], agg)
    return stmt.on_conflict_do_update(
        index_elements=["tenant_id", "usage_day", "base_model", "adapter", "priority"],
        index_where=li.c.invoice_id.is_(None),
        set_={"requests": li.c.requests + stmt.excluded.requests,
              "input_tokens": li.c.input_tokens + stmt.excluded.input_tokens,
              "cached_input_tokens": li.c.cached_input_tokens + stmt.excluded.cached_input_tokens,
              "output_tokens": li.c.output_tokens + stmt.excluded.output_tokens})


def price_pending(conn: Connection) -> None:
    """(Re-)price every pending line item from the price book; amount NULL where a price is missing.

    Prices are looked up once per distinct (tenant, base model, priority, day), not per item
    (items differ by adapter too), and only rows whose price or amount changes are written.
    Cached input tokens are priced at the cached_input price, else the input price; the amount is
    exact picos per kind: (input - cached) x input + cached x cached_input + output x output."""
    li = LineItem.__table__
    keys = (li.c.tenant_id, li.c.base_model, li.c.priority, li.c.usage_day)
    distinct = select(*keys).where(li.c.invoice_id.is_(None)).distinct().subquery("k")
    raw = select(*distinct.c, *(price_expr(*distinct.c, kind).label(kind) for kind in TOKEN_KINDS)).subquery("r")
    lookup = select(*(raw.c[col.name] for col in keys), raw.c.input.label("input_price"),
                    func.coalesce(raw.c.cached_input, raw.c.input).label("cached_input_price"),
                    raw.c.output.label("output_price")).subquery("p")
    prices = ("input_price", "cached_input_price", "output_price")
    conn.execute(update(li)
                 .where(li.c.invoice_id.is_(None), *(col == lookup.c[col.name] for col in keys),
                        or_(*(li.c[p].is_distinct_from(lookup.c[p]) for p in prices)))
                 .values({p: lookup.c[p] for p in prices}))
    amount = ((li.c.input_tokens - li.c.cached_input_tokens) * li.c.input_price
              + li.c.cached_input_tokens * li.c.cached_input_price + li.c.output_tokens * li.c.output_price)
    conn.execute(update(li).where(li.c.invoice_id.is_(None), li.c.amount_picos.is_distinct_from(amount))
                 .values(amount_picos=amount))


def held_usage(conn: Connection, *, tenant_id: int | None = None, before: date | None = None) -> list[HeldUsage]:
    """Pending usage without a price, per missing (base model, priority, token kind); optionally
    one tenant's, with usage days before `before`. A missing input price holds all the item's
    input tokens, cached ones too (they fall back to it); a cached_input price is never missing
    on its own."""
    li = LineItem.__table__
    where = [li.c.invoice_id.is_(None)]
    if tenant_id is not None:
        where.append(li.c.tenant_id == tenant_id)
    if before is not None:
        where.append(li.c.usage_day < before)
    out = []
    for kind, price_col, tokens_col in (("input", li.c.input_price, li.c.input_tokens),
                                        ("output", li.c.output_price, li.c.output_tokens)):
        rows = conn.execute(select(li.c.base_model, li.c.priority, func.count(func.distinct(li.c.tenant_id)),
                                   func.count(), func.sum(tokens_col))
                            .where(*where, price_col.is_(None))
                            .group_by(li.c.base_model, li.c.priority)
                            .order_by(li.c.base_model, li.c.priority))
        out += [HeldUsage(m, p, kind, int(t), int(n), int(tok or 0)) for m, p, t, n, tok in rows]
    return out


def rollup(db: Engine, *, cutoff: datetime | None = None) -> RollupReport:
    """Bill every not-yet-billed usage event created before `cutoff` (default: now); see the
    module docstring. Returns what it did, and the usage held for want of a price."""
    cutoff = cutoff or utcnow()
    if cutoff.tzinfo is None:
        raise ValueError("cutoff must be timezone-aware")
    cutoff = cutoff.astimezone(timezone.utc)  # SQLite compares timestamps as UTC text
    dialect = db.dialect.name
    e = UsageEvent.__table__
    pending = and_(e.c.billing_run_id.is_(None), e.c.created_at < cutoff)
    with db.begin() as conn:
        take_billing_lock(conn)
        if dialect == "postgresql":
            # Sort/hash a whole run's events in memory rather than spilling to disk (this transaction only).
            conn.execute(text("SET LOCAL work_mem = '128MB'"))
        run_id = conn.execute(insert(BillingRun.__table__).values(started_at=utcnow(), cutoff=cutoff, events=0)
                              .returning(BillingRun.__table__.c.id)).scalar_one()
        cols = (e.c.tenant_id, e.c.created_at, e.c.base_model, e.c.model, e.c.adapter_version, e.c.priority,
                e.c.prompt_tokens, e.c.cached_tokens, e.c.completion_tokens)
        if dialect == "postgresql":
            marked = update(e).where(pending).values(billing_run_id=run_id).returning(*cols).cte("marked")
            summed = _sum_into_line_items(marked, dialect).cte("summed")
            events = conn.execute(select(func.count()).select_from(marked).add_cte(summed)).scalar_one()
        else:
            src = select(*cols).where(pending).subquery("unbilled")
            conn.execute(_sum_into_line_items(src, dialect))
            events = conn.execute(update(e).where(pending).values(billing_run_id=run_id)).rowcount
        price_pending(conn)
        held = held_usage(conn)
        conn.execute(update(BillingRun.__table__).where(BillingRun.__table__.c.id == run_id)
                     .values(events=events, finished_at=utcnow()))
    return RollupReport(run_id=run_id, events=int(events), cutoff=cutoff, held=held)
