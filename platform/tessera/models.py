"""The platform's tables on the shared metadata: plans, per-tenant quota overrides, API keys and
usage events. (Tenants and adapters are the registry's, in adapter_registry.models.)

A NULL limit means unlimited; a NULL override means "the plan's value".
"""
from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, CheckConstraint, DateTime, Float, ForeignKey, Index, Integer, String, text
from sqlalchemy.orm import Mapped, mapped_column

from engine.sampling_params import PRIORITY_NAMES, Priority
from tessera_core.db import Base, utcnow

PRIORITIES = PRIORITY_NAMES  # the engine's classes are the platform's
USAGE_STATUSES = ("completed", "aborted", "error")


class Plan(Base):
    """Quotas and priority classes a tenant gets unless its TenantPolicy overrides them."""

    __tablename__ = "plans"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    requests_per_minute: Mapped[int | None] = mapped_column(Integer)
    tokens_per_minute: Mapped[int | None] = mapped_column(BigInteger)
    max_concurrent_requests: Mapped[int | None] = mapped_column(Integer)
    monthly_token_budget: Mapped[int | None] = mapped_column(BigInteger)
    allowed_priorities: Mapped[list[Any]] = mapped_column(JSON, default=lambda: [Priority.standard.name, Priority.batch.name])
    default_priority: Mapped[str] = mapped_column(String(16), default=Priority.standard.name)
    #: Tokens a month the plan includes at no charge (billing credits them on the invoice).
    monthly_included_tokens: Mapped[int | None] = mapped_column(BigInteger)
    #: Its tenants' weight in the engine's fair shares of KV blocks and prefill tokens inside a
    #: priority class (engine.scheduler), in (0, engine.scheduler.MAX_TENANT_WEIGHT].
    scheduling_weight: Mapped[float] = mapped_column(Float, default=1.0, server_default=text("1"))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class TenantPolicy(Base):
    """A tenant's plan and its overrides (one row per tenant the platform serves)."""

    __tablename__ = "tenant_policies"

    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    plan_id: Mapped[int] = mapped_column(ForeignKey("plans.id"))
    requests_per_minute: Mapped[int | None] = mapped_column(Integer)
    tokens_per_minute: Mapped[int | None] = mapped_column(BigInteger)
    max_concurrent_requests: Mapped[int | None] = mapped_column(Integer)
    monthly_token_budget: Mapped[int | None] = mapped_column(BigInteger)
    allowed_priorities: Mapped[list[Any] | None] = mapped_column(JSON)
    default_priority: Mapped[str | None] = mapped_column(String(16))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, onupdate=utcnow)


class ApiKey(Base):
    """A tenant's API key: only `prefix` (for lookup) and the sha256 of the whole key are kept."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    prefix: Mapped[str] = mapped_column(String(16), unique=True)
    key_hash: Mapped[str] = mapped_column(String(64))
    name: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class UsageEvent(Base):
    """One request's usage, keyed by its request id (recording it twice keeps the first).

    billing_run_id is set, once, by the billing rollup that summed the event into a line item;
    the partial index finds the events no rollup has taken yet without scanning the rest."""

    __tablename__ = "usage_events"
    __table_args__ = (
        CheckConstraint("status IN ('completed', 'aborted', 'error')", name="status"),
        Index("ix_usage_events_unbilled", "created_at", sqlite_where=text("billing_run_id IS NULL"),
              postgresql_where=text("billing_run_id IS NULL")),
        # Every read is one tenant's events in a time range (usage API, budgets, SLOs, exports):
        # one composite index serves them all, and costs each insert and rollup one index write
        # instead of two.
        Index("ix_usage_events_tenant_id_created_at", "tenant_id", "created_at"),
    )

    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"))
    api_key_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id"))
    model: Mapped[str] = mapped_column(String(200))
    base_model: Mapped[str | None] = mapped_column(String(200))  # NULL in events recorded before billing
    adapter_version: Mapped[str | None] = mapped_column(String(64))  # sha256; NULL = base model
    priority: Mapped[str] = mapped_column(String(16))
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    #: Of prompt_tokens, those whose KV the engine's prefix cache already held (0 <= cached_tokens
    #: <= prompt_tokens, metering.Usage keeps it so); billing prices them as the cached_input kind.
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    #: The request's `user` and `safety_identifier` (OpenAI's), for the tenant's own reports.
    end_user: Mapped[str | None] = mapped_column(String(256))
    safety_identifier: Mapped[str | None] = mapped_column(String(256))
    status: Mapped[str] = mapped_column(String(16))
    finish_reason: Mapped[str | None] = mapped_column(String(16))
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    duration_ms: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # billing_runs.id; deliberately no foreign key: checking one per event would cost the rollup
    # a fifth of its time, and only the rollup writes this column.
    billing_run_id: Mapped[int | None] = mapped_column(BigInteger)


class StoredResponse(Base):
    """A /v1/responses answer kept for GET /v1/responses/{id} and `previous_response_id` (the
    request's `store`, true by default): its own input items (as the request gave them,
    normalized) and output items, so a chain is rebuilt by following previous_response_id.
    Only its tenant reads or deletes it; it expires after responses_retention_days and goes with
    its tenant (tessera.responses_store)."""

    __tablename__ = "responses"
    __table_args__ = (
        # Reads are one tenant's id; retention deletes by age across tenants.
        Index("ix_responses_tenant_id_created_at", "tenant_id", "created_at"),
        Index("ix_responses_created_at", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # "resp_..."
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    api_key_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id", ondelete="SET NULL"))
    model: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16))  # completed | incomplete | failed
    previous_response_id: Mapped[str | None] = mapped_column(String(64))
    instructions: Mapped[str | None] = mapped_column(String)
    input_items: Mapped[list[Any]] = mapped_column(JSON)
    output_items: Mapped[list[Any]] = mapped_column(JSON)
    usage: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata", JSON)
    #: The rest of the response object as answered (tools, tool_choice, text, sampling fields...).
    params: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
