"""Tenants, plans, API keys and effective quota policies (keyword-only, caller's Session).

API keys look like `tsk-<prefix>.<secret>`: 12 characters of lookup prefix and 43 of secret,
both from the OS's CSPRNG (32 bytes of secret). The database keeps the prefix and the sha256 of
the whole key; the key itself is returned once, by `issue_key`. A fast hash is enough because
the secret has 256 bits of entropy (no dictionary to guess from), and it keeps auth cheap.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from adapter_registry import services as registry
from adapter_registry.errors import Conflict, NotFound
from adapter_registry.models import TENANT_STATUSES, Tenant
from adapter_registry.names import check_label
from engine.scheduler import MAX_TENANT_WEIGHT
from tessera.models import PRIORITIES, ApiKey, Plan, TenantPolicy
from tessera.quota import Limits
from tessera_core.db import utcnow

KEY_PREFIX = "tsk-"
LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests", "monthly_token_budget")


@dataclass(frozen=True)
class Policy:
    """A tenant's effective limits and priority classes (plan, then tenant overrides)."""

    limits: Limits
    allowed_priorities: tuple[str, ...]
    default_priority: str
    plan: str
    #: The plan's weight in the engine's fair shares (GenerationRequest.tenant_weight).
    scheduling_weight: float = 1.0


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def split_key(key: str) -> tuple[str, str] | None:
    """(prefix, key) of a well-formed key, else None."""
    if not key.startswith(KEY_PREFIX):
        return None
    prefix, dot, secret = key[len(KEY_PREFIX):].partition(".")
    if not dot or len(prefix) != 12 or len(secret) < 43:
        return None
    return prefix, key


def _check_priorities(allowed: list[str] | None, default: str | None) -> None:
    for p in (allowed or []) + ([default] if default else []):
        if p not in PRIORITIES:
            raise ValueError(f"unknown priority class {p!r} (use {', '.join(PRIORITIES)})")
    if allowed is not None and not allowed:
        raise ValueError("allowed_priorities must name at least one class")
    if allowed and default and default not in allowed:
        raise ValueError(f"default priority {default!r} is not among the allowed {allowed}")


def upsert_plan(*, session: Session, name: str, allowed_priorities: list[str] | None = None,
                default_priority: str | None = None, monthly_included_tokens: int | None = ...,
                scheduling_weight: float | None = None, **limits: int | None) -> Plan:
    """Create the plan `name` or update it with the given values; commits. ValueError on bad classes.
    monthly_included_tokens (billing's free allowance): None clears it; left out, it is unchanged.
    scheduling_weight (engine.scheduler's fair-share weight, default 1): None leaves it."""
    unknown = set(limits) - set(LIMIT_FIELDS)
    if unknown:
        raise ValueError(f"unknown plan fields {sorted(unknown)}")
    plan = session.scalar(select(Plan).where(Plan.name == name))
    if plan is None:
        plan = Plan(name=name, allowed_priorities=["standard", "batch"], default_priority="standard")
        session.add(plan)
    for k, v in limits.items():
        setattr(plan, k, v)
    if allowed_priorities is not None:
        plan.allowed_priorities = list(allowed_priorities)
    if default_priority is not None:
        plan.default_priority = default_priority
    if monthly_included_tokens is not ...:
        if monthly_included_tokens is not None and monthly_included_tokens < 0:
            raise ValueError("monthly_included_tokens must be >= 0")
        plan.monthly_included_tokens = monthly_included_tokens
    if scheduling_weight is not None:
        if not 0 < scheduling_weight <= MAX_TENANT_WEIGHT:
            raise ValueError(f"scheduling_weight must be in (0, {MAX_TENANT_WEIGHT:g}]")
        plan.scheduling_weight = float(scheduling_weight)
    _check_priorities(plan.allowed_priorities, plan.default_priority)
    session.commit()
    return plan


def get_plan(*, session: Session, name: str) -> Plan:
    plan = session.scalar(select(Plan).where(Plan.name == name))
    if plan is None:
        raise NotFound(f"plan {name!r} not found; create it with PUT /admin/v1/plans/{name}")
    return plan


def create_tenant(*, session: Session, name: str, plan: str) -> Tenant:
    """Create a tenant on `plan` (which must exist); Conflict if the name is taken."""
    plan_row = get_plan(session=session, name=plan)
    tenant = registry.create_tenant(session=session, name=name)
    session.add(TenantPolicy(tenant_id=tenant.id, plan_id=plan_row.id))
    session.commit()
    return tenant


def set_policy(*, session: Session, tenant: Tenant, plan: str | None = None, values: dict) -> Policy:
    """Change the tenant's plan and/or overrides (a None value clears an override); commits."""
    pol = session.get(TenantPolicy, tenant.id)
    if pol is None:
        pol = TenantPolicy(tenant_id=tenant.id, plan_id=get_plan(session=session, name=plan or "default").id)
        session.add(pol)
    if plan is not None:
        pol.plan_id = get_plan(session=session, name=plan).id
    for k, v in values.items():
        if k not in LIMIT_FIELDS + ("allowed_priorities", "default_priority"):
            raise ValueError(f"unknown quota field {k!r}")
        setattr(pol, k, v)
    session.flush()
    effective = policy_for(session=session, tenant_id=tenant.id)
    _check_priorities(list(effective.allowed_priorities), effective.default_priority)
    session.commit()
    return effective


def _merge(pol: TenantPolicy, plan: Plan) -> Policy:
    def pick(field: str):
        v = getattr(pol, field)
        return getattr(plan, field) if v is None else v

    return Policy(
        limits=Limits(**{f: pick(f) for f in LIMIT_FIELDS}),
        allowed_priorities=tuple(pick("allowed_priorities")),
        default_priority=pick("default_priority"),
        plan=plan.name,
        scheduling_weight=plan.scheduling_weight,
    )


def policy_for(*, session: Session, tenant_id: int) -> Policy:
    """The tenant's effective policy; NotFound if the platform has none for it."""
    row = session.execute(select(TenantPolicy, Plan).join(Plan, Plan.id == TenantPolicy.plan_id)
                          .where(TenantPolicy.tenant_id == tenant_id)).first()
    if row is None:
        raise NotFound(f"tenant {tenant_id} has no plan")
    return _merge(*row)


def issue_key(*, session: Session, tenant: Tenant, name: str | None = None) -> tuple[ApiKey, str]:
    """Create a key for the tenant; returns the row and the key (the only time it is visible).
    A name is a label (adapter_registry.names.check_label: InvalidName, 422, otherwise)."""
    if name is not None:
        check_label(name, what="API key name")
    if tenant.status != "active":
        raise Conflict(f"tenant {tenant.name!r} is {tenant.status}")
    prefix = secrets.token_urlsafe(9)  # 12 characters
    key = f"{KEY_PREFIX}{prefix}.{secrets.token_urlsafe(32)}"
    row = ApiKey(tenant_id=tenant.id, prefix=prefix, key_hash=hash_key(key), name=name)
    session.add(row)
    session.commit()
    return row, key


def revoke_key(*, session: Session, tenant: Tenant, key_id: int) -> ApiKey:
    """Revoke one of the tenant's keys (idempotent); NotFound for another tenant's key."""
    row = session.scalar(select(ApiKey).where(ApiKey.id == key_id, ApiKey.tenant_id == tenant.id))
    if row is None:
        raise NotFound(f"key {key_id} not found")
    if row.revoked_at is None:
        row.revoked_at = utcnow()
        session.commit()
    return row


def list_plans(*, session: Session) -> list[Plan]:
    """Every plan, by name."""
    return list(session.scalars(select(Plan).order_by(Plan.name)))


def list_tenants(*, session: Session) -> list[Tenant]:
    """Every live tenant (active or suspended), by name."""
    return list(session.scalars(select(Tenant).where(Tenant.deleted_at.is_(None)).order_by(Tenant.name)))


def tenant_overrides(*, session: Session, tenant: Tenant) -> dict:
    """The tenant's own values over its plan's: {field: value or None (= the plan's)}."""
    pol = session.get(TenantPolicy, tenant.id)
    fields = LIMIT_FIELDS + ("allowed_priorities", "default_priority")
    return {f: (getattr(pol, f) if pol is not None else None) for f in fields}


def set_tenant_status(*, session: Session, tenant: Tenant, status: str) -> Tenant:
    """Suspend ('suspended') or reactivate ('active') a tenant; commits. A suspended tenant's keys
    are refused (403) and its uploads too; its adapters, keys and usage are kept."""
    if status not in TENANT_STATUSES:
        raise ValueError(f"unknown tenant status {status!r} (use {', '.join(TENANT_STATUSES)})")
    tenant.status = status
    session.commit()
    return tenant


def list_keys(*, session: Session, tenant: Tenant) -> list[ApiKey]:
    """The tenant's keys, revoked ones included, newest first."""
    return list(session.scalars(select(ApiKey).where(ApiKey.tenant_id == tenant.id)
                                .order_by(ApiKey.created_at.desc(), ApiKey.id.desc())))


class TenantSuspended(Exception):
    """A valid, unrevoked key whose tenant is suspended (the gateway answers 403)."""


@dataclass(frozen=True)
class Caller:
    """An authenticated request's tenant, key and policy."""

    tenant_id: int
    tenant_name: str
    key_id: int
    policy: Policy


def authenticate(*, session: Session, key: str) -> Caller | None:
    """The caller a key belongs to, or None if the key is malformed, unknown, revoked, or its
    tenant is deleted. TenantSuspended for a valid key of a suspended tenant. One indexed query;
    compares hashes in constant time."""
    parts = split_key(key)
    if parts is None:
        return None
    row = session.execute(
        select(ApiKey, Tenant, TenantPolicy, Plan)
        .join(Tenant, Tenant.id == ApiKey.tenant_id)
        .join(TenantPolicy, TenantPolicy.tenant_id == Tenant.id)
        .join(Plan, Plan.id == TenantPolicy.plan_id)
        .where(ApiKey.prefix == parts[0])
    ).first()
    if row is None:
        return None
    api_key, tenant, pol, plan = row
    if not hmac.compare_digest(api_key.key_hash, hash_key(key)):
        return None
    if api_key.revoked_at is not None or tenant.deleted_at is not None:
        return None
    if tenant.status != "active":
        raise TenantSuspended(tenant.name)
    return Caller(tenant.id, tenant.name, api_key.id, _merge(pol, plan))
