"""Billing tables: the price book, rollup runs, line items, invoices and exports.

Money is integer, never float. A price is `micros_per_mtok`: micro-units of the currency per
million tokens, which is numerically the same as pico-units (1e-12) per token. So a line item's
exact amount is `tokens x price` in picos (`amount_picos`), with no rounding anywhere; rounding
to micro-units happens once, on an invoice's total (see invoices.py).

Token kinds: `input` (prompt tokens), `output` (completion tokens) and `cached_input` (the prompt
tokens the engine's prefix cache served). Token counts follow OpenAI's usage: `input_tokens` are
all prompt tokens and `cached_input_tokens` are those of them that were cached, so an item's
amount is (input - cached_input) x input price + cached_input x cached_input price + output x
output price. With no cached_input price in effect, cached tokens are billed at the input price,
which is exactly the amount they had before the kind existed. A line item (one tenant,
day, model, adapter and class) holds up to 2^63 picos, 9.2 million currency units; past that
Postgres refuses the rollup (integer overflow) rather than bill a wrong amount.
"""
from __future__ import annotations

from datetime import date, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    Date,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    String,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

from tessera_core.db import Base, utcnow

TOKEN_KINDS = ("input", "cached_input", "output")
EXPORT_FORMATS = ("csv", "parquet", "jsonl")
#: picos per micro-unit: an amount in picos / PICOS_PER_MICRO is micro-units.
PICOS_PER_MICRO = 1_000_000


class Price(Base):
    """One price: (base model, priority class, token kind) from `effective_from` (a UTC day) on,
    until a later entry for the same key. tenant_id NULL is the book; a tenant's own entry is its
    contract price and wins over the book for that tenant, whatever the dates."""

    __tablename__ = "billing_prices"
    __table_args__ = (
        CheckConstraint("token_kind IN ('input', 'cached_input', 'output')", name="token_kind"),
        CheckConstraint("micros_per_mtok >= 0", name="non_negative"),
        Index("uq_billing_prices_book", "base_model", "priority", "token_kind", "effective_from", unique=True,
              sqlite_where=text("tenant_id IS NULL"), postgresql_where=text("tenant_id IS NULL")),
        Index("uq_billing_prices_tenant", "tenant_id", "base_model", "priority", "token_kind", "effective_from",
              unique=True, sqlite_where=text("tenant_id IS NOT NULL"), postgresql_where=text("tenant_id IS NOT NULL")),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int | None] = mapped_column(ForeignKey("tenants.id"))
    base_model: Mapped[str] = mapped_column(String(200))
    priority: Mapped[str] = mapped_column(String(16))
    token_kind: Mapped[str] = mapped_column(String(16))
    micros_per_mtok: Mapped[int] = mapped_column(BigInteger)
    effective_from: Mapped[date] = mapped_column(Date)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class BillingRun(Base):
    """One rollup: which usage events it billed (usage_events.billing_run_id points here)."""

    __tablename__ = "billing_runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cutoff: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    events: Mapped[int] = mapped_column(BigInteger, default=0)


class Invoice(Base):
    """A closed billing period (a UTC calendar month) of one tenant. Totals are in micro-units,
    rounded once (half up) from the exact sum of its line items in picos."""

    __tablename__ = "billing_invoices"
    __table_args__ = (UniqueConstraint("tenant_id", "period_start"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    period_start: Mapped[date] = mapped_column(Date)
    period_end: Mapped[date] = mapped_column(Date)  # exclusive
    currency: Mapped[str] = mapped_column(String(3))
    line_items: Mapped[int] = mapped_column(Integer)
    requests: Mapped[int] = mapped_column(BigInteger)
    input_tokens: Mapped[int] = mapped_column(BigInteger)
    cached_input_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))  # of input_tokens
    output_tokens: Mapped[int] = mapped_column(BigInteger)
    subtotal_micros: Mapped[int] = mapped_column(BigInteger)
    allowance_tokens: Mapped[int] = mapped_column(BigInteger)  # the plan's monthly included tokens
    allowance_used_tokens: Mapped[int] = mapped_column(BigInteger)
    allowance_credit_micros: Mapped[int] = mapped_column(BigInteger)
    total_micros: Mapped[int] = mapped_column(BigInteger)
    #: Usage held out of this invoice for want of a price: [{base_model, priority, token_kind, tokens}].
    held: Mapped[list[Any]] = mapped_column(JSON, default=list)
    closed_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class LineItem(Base):
    """Usage of one tenant on one UTC day, per (base model, adapter, priority class), priced.

    Pending (invoice_id NULL) items are summed into by every rollup and re-priced from the price
    book; an invoiced item never changes. adapter '' is the base model itself. A price NULL means
    the book has none for it: the item is held (not invoiced) until one exists."""

    __tablename__ = "billing_line_items"
    __table_args__ = (
        Index("uq_billing_line_items_pending", "tenant_id", "usage_day", "base_model", "adapter", "priority",
              unique=True, sqlite_where=text("invoice_id IS NULL"), postgresql_where=text("invoice_id IS NULL")),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"))
    usage_day: Mapped[date] = mapped_column(Date)
    base_model: Mapped[str] = mapped_column(String(200))
    adapter: Mapped[str] = mapped_column(String(200))
    priority: Mapped[str] = mapped_column(String(16))
    requests: Mapped[int] = mapped_column(BigInteger)
    input_tokens: Mapped[int] = mapped_column(BigInteger)  # all prompt tokens, cached ones included
    cached_input_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))  # of input_tokens
    output_tokens: Mapped[int] = mapped_column(BigInteger)
    input_price: Mapped[int | None] = mapped_column(BigInteger)  # micros per 1M tokens
    #: What cached_input_tokens are billed at: the cached_input price, else the input price.
    cached_input_price: Mapped[int | None] = mapped_column(BigInteger)
    output_price: Mapped[int | None] = mapped_column(BigInteger)
    amount_picos: Mapped[int | None] = mapped_column(BigInteger)
    invoice_id: Mapped[int | None] = mapped_column(ForeignKey("billing_invoices.id"), index=True)


class Export(Base):
    """A file written to the object store for (tenant, period, format); regenerating replaces it."""

    __tablename__ = "billing_exports"
    __table_args__ = (UniqueConstraint("tenant_id", "period_start", "format"),
                      CheckConstraint("format IN ('csv', 'parquet', 'jsonl')", name="format"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    period_start: Mapped[date] = mapped_column(Date)
    format: Mapped[str] = mapped_column(String(8))
    object_key: Mapped[str] = mapped_column(String(500))
    sha256: Mapped[str] = mapped_column(String(64))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    rows: Mapped[int] = mapped_column(Integer)
    final: Mapped[bool] = mapped_column(default=False)  # the period was invoiced when it was written
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
