"""The price book: set, list and look up prices (see models.Price for the rules).

`price_expr(line_item_columns, kind)` is the same lookup as a correlated SQL subquery, which the
rollup uses to price every pending line item in one statement; `PriceBook` does it in Python
for small reads (the usage API's cost). Both pick, for (tenant, base model, priority, kind, day):
the tenant's own entries if it has any in effect that day, else the book's; among those, the
latest effective_from <= day. Each kind is looked up on its own; the callers bill cached input
tokens at the input price where the cached_input lookup finds nothing (rollup.price_pending,
usage_query).
"""
from __future__ import annotations

from collections import defaultdict
from datetime import date

from sqlalchemy import and_, case, or_, select
from sqlalchemy.orm import Session

from tessera.billing.models import TOKEN_KINDS, Price
from tessera.models import PRIORITIES


def set_price(*, session: Session, base_model: str, priority: str, token_kind: str, micros_per_mtok: int,
              effective_from: date, tenant_id: int | None = None) -> Price:
    """Create or replace the entry for this key and day; commits. ValueError on a bad value.

    Replacing an entry re-prices pending line items at the next rollup; invoiced ones keep the
    price they were invoiced at."""
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}")
    if token_kind not in TOKEN_KINDS:
        raise ValueError(f"token_kind must be one of {', '.join(TOKEN_KINDS)}")
    if not isinstance(micros_per_mtok, int) or isinstance(micros_per_mtok, bool) or micros_per_mtok < 0:
        raise ValueError("micros_per_mtok must be a non-negative integer (micro-units per million tokens)")
    if not base_model:
        raise ValueError("base_model is required")
    tenant_match = Price.tenant_id.is_(None) if tenant_id is None else Price.tenant_id == tenant_id
    row = session.scalar(select(Price).where(tenant_match, Price.base_model == base_model, Price.priority == priority,
                                             Price.token_kind == token_kind, Price.effective_from == effective_from))
    if row is None:
        row = Price(tenant_id=tenant_id, base_model=base_model, priority=priority, token_kind=token_kind,
                    effective_from=effective_from, micros_per_mtok=micros_per_mtok)
        session.add(row)
    else:
        row.micros_per_mtok = micros_per_mtok
    session.commit()
    return row


def list_prices(*, session: Session, tenant_id: int | None = None, include_book: bool = True) -> list[Price]:
    """The book (tenant_id None), or a tenant's contract prices (plus the book if include_book)."""
    if tenant_id is None:
        where = Price.tenant_id.is_(None)
    elif include_book:
        where = or_(Price.tenant_id.is_(None), Price.tenant_id == tenant_id)
    else:
        where = Price.tenant_id == tenant_id
    return list(session.scalars(select(Price).where(where).order_by(
        Price.tenant_id.is_(None), Price.base_model, Price.priority, Price.token_kind, Price.effective_from)))


def price_expr(tenant_id, base_model, priority, day, kind: str):
    """A scalar subquery: the price in effect for these (SQL) columns and token `kind`, or NULL."""
    return (select(Price.micros_per_mtok)
            .where(Price.base_model == base_model, Price.priority == priority, Price.token_kind == kind,
                   Price.effective_from <= day, or_(Price.tenant_id.is_(None), Price.tenant_id == tenant_id))
            # Contract entries first, then the latest effective date.
            .order_by(case((Price.tenant_id.is_(None), 1), else_=0), Price.effective_from.desc())
            .limit(1).scalar_subquery())


class PriceBook:
    """The prices one tenant sees, loaded once, for lookups in Python."""

    def __init__(self, session: Session, tenant_id: int):
        self._entries: dict[tuple, list[tuple[date, int]]] = defaultdict(list)
        rows = session.execute(select(Price.tenant_id, Price.base_model, Price.priority, Price.token_kind,
                                      Price.effective_from, Price.micros_per_mtok)
                               .where(or_(Price.tenant_id.is_(None), and_(Price.tenant_id == tenant_id))))
        for t, model, prio, kind, eff, micros in rows:
            self._entries[(t is not None, model, prio, kind)].append((eff, micros))
        for v in self._entries.values():
            v.sort()

    def price(self, base_model: str, priority: str, kind: str, day: date) -> int | None:
        """Micros per 1M tokens in effect on `day`, or None when there is none."""
        for contract in (True, False):
            best = None
            for eff, micros in self._entries.get((contract, base_model, priority, kind), ()):
                if eff <= day:
                    best = micros
                else:
                    break
            if best is not None:
                return best
        return None
