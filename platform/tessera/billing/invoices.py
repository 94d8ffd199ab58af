"""Closing a billing period into an invoice, and reading periods back.

Periods are UTC calendar months. `close_period(tenant, period)`:
- is idempotent: closing a closed period returns its invoice, unchanged;
- refuses a period that has not ended yet (plus the grace, for events still being written);
- closes the tenant's earlier periods that still have pending usage first, in order, so every
  invoice holds its own month;
- takes, under the billing lock, every pending *priced* line item of the tenant whose usage day
  is before the period's end. That is the period's own usage, plus late usage: events of an
  already-invoiced month that arrived after its close land on the next invoice closed, with
  their real usage day (the late-event rule, docs/ARCHITECTURE.md);
- leaves items without a price pending (held, listed on the invoice): they are invoiced by the
  first close after a price exists, never at zero.

Totals: subtotal = the exact sum of the items' amounts in picos. A plan's monthly included
tokens are credited against the period's own usage, first day first (within a day by base
model, adapter, priority; uncached input tokens, then cached input tokens, then output), each
token at its item's own price for its kind.
The invoice's total is rounded once, half up, to micro-units; subtotal and credit are rounded
the same way so that subtotal - credit = total exactly as printed.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime, timedelta

from sqlalchemy import func, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session

from adapter_registry.errors import Conflict
from tessera.billing.models import PICOS_PER_MICRO, Invoice, LineItem
from tessera.billing.periods import Period
from tessera.billing.rollup import held_usage, take_billing_lock
from tessera.models import Plan, TenantPolicy
from tessera_core.db import utcnow


class PeriodNotEnded(Conflict):
    """The period can still receive usage."""


def round_picos(picos: int) -> int:
    """Picos -> micro-units, half up (amounts are never negative)."""
    return (picos + PICOS_PER_MICRO // 2) // PICOS_PER_MICRO


@dataclass
class AllowanceResult:
    used_tokens: int
    credit_picos: int


def apply_allowance(items: list[LineItem], allowance: int, period: Period) -> AllowanceResult:
    """Credit up to `allowance` tokens of the period's own usage (see the module docstring)."""
    left, credit = allowance, 0
    own = sorted((i for i in items if period.start <= i.usage_day < period.end),
                 key=lambda i: (i.usage_day, i.base_model, i.adapter, i.priority))
    for item in own:
        for tokens, price in ((item.input_tokens - item.cached_input_tokens, item.input_price),
                              (item.cached_input_tokens, item.cached_input_price),
                              (item.output_tokens, item.output_price)):
            take = min(left, tokens)
            if take:
                credit += take * price
                left -= take
        if left == 0:
            break
    return AllowanceResult(allowance - left, credit)


def _included_tokens(session: Session, tenant_id: int) -> int:
    v = session.scalar(select(Plan.monthly_included_tokens).join(TenantPolicy, TenantPolicy.plan_id == Plan.id)
                       .where(TenantPolicy.tenant_id == tenant_id))
    return int(v or 0)


def _close_one(db: Engine, tenant_id: int, period: Period, currency: str) -> Invoice:
    with Session(db, expire_on_commit=False) as session:
        take_billing_lock(session.connection())
        existing = session.scalar(select(Invoice).where(Invoice.tenant_id == tenant_id,
                                                        Invoice.period_start == period.start))
        if existing is not None:  # closed meanwhile by someone else
            return existing
        invoice = Invoice(tenant_id=tenant_id, period_start=period.start, period_end=period.end, currency=currency,
                          line_items=0, requests=0, input_tokens=0, cached_input_tokens=0, output_tokens=0,
                          subtotal_micros=0,
                          allowance_tokens=0, allowance_used_tokens=0, allowance_credit_micros=0, total_micros=0,
                          held=[], closed_at=utcnow())
        session.add(invoice)
        session.flush()  # on SQLite this first write takes the write lock
        due = (LineItem.tenant_id == tenant_id, LineItem.invoice_id.is_(None), LineItem.amount_picos.is_not(None),
               LineItem.usage_day < period.end)
        session.execute(update(LineItem).where(*due).values(invoice_id=invoice.id))
        items = list(session.scalars(select(LineItem).where(LineItem.invoice_id == invoice.id)))
        subtotal = sum(i.amount_picos for i in items)
        allowance = _included_tokens(session, tenant_id)
        credit = apply_allowance(items, allowance, period)
        invoice.line_items = len(items)
        invoice.requests = sum(i.requests for i in items)
        invoice.input_tokens = sum(i.input_tokens for i in items)
        invoice.cached_input_tokens = sum(i.cached_input_tokens for i in items)
        invoice.output_tokens = sum(i.output_tokens for i in items)
        invoice.total_micros = round_picos(subtotal - credit.credit_picos)
        invoice.subtotal_micros = round_picos(subtotal)
        invoice.allowance_credit_micros = invoice.subtotal_micros - invoice.total_micros
        invoice.allowance_tokens = allowance
        invoice.allowance_used_tokens = credit.used_tokens
        invoice.held = [h.__dict__ for h in held_usage(session.connection(), tenant_id=tenant_id, before=period.end)]
        session.commit()
        return invoice


def close_period(db: Engine, *, tenant_id: int, period: Period, currency: str, now: datetime | None = None,
                 grace: timedelta = timedelta(0)) -> Invoice:
    """Close `period` for the tenant (and its earlier periods with pending usage); see the module
    docstring. Run a rollup first for the invoice to include the latest events."""
    now = now or utcnow()
    with Session(db) as session:
        existing = session.scalar(select(Invoice).where(Invoice.tenant_id == tenant_id,
                                                        Invoice.period_start == period.start))
        if existing is not None:
            return existing
        closable_from = period.end_datetime() + grace
        if now < closable_from:
            raise PeriodNotEnded(f"period {period} has not ended: it can be closed from "
                                 f"{closable_from.isoformat().replace('+00:00', 'Z')}")
        earlier = session.scalars(
            select(func.min(LineItem.usage_day)).where(LineItem.tenant_id == tenant_id, LineItem.invoice_id.is_(None),
                                                        LineItem.amount_picos.is_not(None),
                                                        LineItem.usage_day < period.start)).first()
        closed = {row for row in session.scalars(select(Invoice.period_start).where(Invoice.tenant_id == tenant_id))}
    if earlier is not None:
        p = Period.of(earlier)
        while p < period:
            if p.start not in closed:
                _close_one(db, tenant_id, p, currency)
            p = p.next()
    return _close_one(db, tenant_id, period, currency)


def due_periods(db: Engine, *, now: datetime, grace: timedelta) -> list[tuple[int, Period]]:
    """(tenant, period) pairs to close, oldest first: months that ended before now - grace, have
    no invoice yet and have pending priced usage, or are the first such month after an invoiced
    one that late usage is waiting in (so late usage is invoiced even if no usage follows it)."""
    last_closable = Period.of(now - grace)  # this month (and later) is still open
    with Session(db) as session:
        rows = session.execute(
            select(LineItem.tenant_id, LineItem.usage_day).where(
                LineItem.invoice_id.is_(None), LineItem.amount_picos.is_not(None),
                LineItem.usage_day < last_closable.start).distinct()).all()
        closed = set(session.execute(select(Invoice.tenant_id, Invoice.period_start)).all())
    due = set()
    for t, d in rows:
        p = Period.of(d)
        while (t, p.start) in closed:  # late usage: the next month not invoiced yet takes it
            p = p.next()
        if p < last_closable:
            due.add((t, p))
    return sorted(due)


def close_due(db: Engine, *, currency: str, now: datetime | None = None,
              grace: timedelta = timedelta(hours=1)) -> list[Invoice]:
    """Close every ended period with pending usage (the beat task). Idempotent."""
    now = now or utcnow()
    return [close_period(db, tenant_id=t, period=p, currency=currency, now=now, grace=grace)
            for t, p in due_periods(db, now=now, grace=grace)]


def period_summary(session: Session, *, tenant_id: int, period: Period) -> dict:
    """The period's invoice (if closed) and its line items: the invoice's when closed, else the
    pending items with usage in the period."""
    invoice = session.scalar(select(Invoice).where(Invoice.tenant_id == tenant_id, Invoice.period_start == period.start))
    if invoice is not None:
        where = (LineItem.invoice_id == invoice.id,)
    else:
        where = (LineItem.tenant_id == tenant_id, LineItem.invoice_id.is_(None),
                 LineItem.usage_day >= period.start, LineItem.usage_day < period.end)
    items = list(session.scalars(select(LineItem).where(*where).order_by(
        LineItem.usage_day, LineItem.base_model, LineItem.adapter, LineItem.priority, LineItem.id)))
    return {"period": period, "invoice": invoice, "line_items": items}


def list_periods(session: Session, *, tenant_id: int) -> list[dict]:
    """Every month with usage or an invoice for the tenant, newest first: status (open, closed),
    the invoice's totals or the pending amounts so far, and held (unpriced) tokens."""
    invoices = {i.period_start: i for i in session.scalars(select(Invoice).where(Invoice.tenant_id == tenant_id))}
    pending: dict[date, dict] = {}
    rows = session.execute(select(LineItem.usage_day, LineItem.requests, LineItem.input_tokens,
                                  LineItem.cached_input_tokens, LineItem.output_tokens, LineItem.amount_picos)
                           .where(LineItem.tenant_id == tenant_id, LineItem.invoice_id.is_(None)))
    for day, n, tin, tcached, tout, amount in rows:
        p = pending.setdefault(Period.of(day).start, {"requests": 0, "input_tokens": 0, "cached_input_tokens": 0,
                                                      "output_tokens": 0, "amount_picos": 0, "held_tokens": 0})
        p["requests"] += n
        p["input_tokens"] += tin
        p["cached_input_tokens"] += tcached
        p["output_tokens"] += tout
        if amount is None:
            p["held_tokens"] += tin + tout
        else:
            p["amount_picos"] += amount
    out = []
    for start in sorted(set(invoices) | set(pending), reverse=True):
        out.append({"period": Period(start), "invoice": invoices.get(start), "pending": pending.get(start)})
    return out

