"""The SLO objectives table (migration 0004): one row per plan (the defaults of its tenants) or
per tenant (overrides). A NULL field means "inherit": a tenant's from its plan's row, a plan's
from the built-in defaults in slo.py.
"""
from __future__ import annotations

from datetime import datetime

from sqlalchemy import CheckConstraint, DateTime, Float, ForeignKey, Integer
from sqlalchemy.orm import Mapped, mapped_column

from tessera_core.db import Base, utcnow


class SloObjective(Base):
    """Availability, TTFT and TPOT objectives of one plan or one tenant (exactly one is set)."""

    __tablename__ = "slo_objectives"
    __table_args__ = (
        CheckConstraint("(plan_id IS NULL) <> (tenant_id IS NULL)", name="one_owner"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    plan_id: Mapped[int | None] = mapped_column(ForeignKey("plans.id", ondelete="CASCADE"), unique=True)
    tenant_id: Mapped[int | None] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), unique=True)
    #: Share of requests that must not fail with a server error (5xx), e.g. 0.995.
    availability_target: Mapped[float | None] = mapped_column(Float)
    #: Time to first token a request must stay under (a TTFT histogram bucket bound, ms).
    ttft_threshold_ms: Mapped[int | None] = mapped_column(Integer)
    #: Share of requests whose TTFT must be under the threshold.
    ttft_target: Mapped[float | None] = mapped_column(Float)
    #: Time per output token a request must stay under (a TPOT histogram bucket bound, ms).
    tpot_threshold_ms: Mapped[int | None] = mapped_column(Integer)
    #: Share of requests whose TPOT must be under the threshold.
    tpot_target: Mapped[float | None] = mapped_column(Float)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, onupdate=utcnow)
