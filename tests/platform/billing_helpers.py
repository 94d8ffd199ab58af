"""Shared helpers of the billing tests: databases, events written the way the gateway writes
them, and an independent reference for prices (a brute-force scan of the test's own price list,
not the code under test)."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import date, datetime, timezone

from sqlalchemy import insert

from adapter_registry.migrate import upgrade
from adapter_registry.models import Tenant
from tessera.billing.prices import set_price
from tessera.models import UsageEvent
from tessera.settings import PlatformSettings
from tessera_core.context import build_context

from ..adapter_registry.conftest import create_pg_database, drop_pg_database

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"


def make_context(kind: str, tmp_path, **overrides):
    """A migrated platform context on 'sqlite' (a file, local objects) or 'postgres' (a fresh
    database). Returns (ctx, cleanup)."""
    if kind == "postgres":
        url = create_pg_database()
    else:
        url = f"sqlite:///{tmp_path / f'billing-{uuid.uuid4().hex[:6]}.db'}"
    settings = PlatformSettings(_env_file=None, database_url=url, object_store_root=tmp_path / "objects", **overrides)
    upgrade(settings)
    ctx = build_context(settings)

    def cleanup():
        ctx.engine.dispose()
        if kind == "postgres":
            drop_pg_database(url)

    return ctx, cleanup


def add_tenant(ctx, name: str | None = None) -> Tenant:
    with ctx.session_factory() as s:
        t = Tenant(name=name or f"t-{uuid.uuid4().hex[:8]}")
        s.add(t)
        s.commit()
        return t


@dataclass
class Ev:
    tenant_id: int
    at: datetime
    prompt: int
    completion: int
    priority: str = "standard"
    adapter: str | None = None
    base_model: str = BASE
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    cached: int = 0  # of prompt, served from the prefix cache


def write_events(ctx, events: list[Ev]) -> None:
    rows = [dict(request_id=e.request_id, tenant_id=e.tenant_id, api_key_id=None,
                 model=e.adapter or e.base_model, base_model=e.base_model,
                 adapter_version=None if e.adapter is None else uuid.uuid5(uuid.NAMESPACE_DNS, e.adapter).hex * 2,
                 priority=e.priority, prompt_tokens=e.prompt, cached_tokens=e.cached, completion_tokens=e.completion,
                 status="completed",
                 finish_reason="stop", ttft_ms=1.0, duration_ms=2.0, created_at=e.at) for e in events]
    with ctx.engine.begin() as conn:
        for i in range(0, len(rows), 5000):
            conn.execute(insert(UsageEvent.__table__), rows[i:i + 5000])


@dataclass
class PriceList:
    """The test's own record of the prices it set, and a brute-force lookup over it."""

    entries: list[tuple] = field(default_factory=list)  # (tenant_id|None, model, prio, kind, eff, micros)

    def set(self, ctx, *, priority: str, kind: str, micros: int, eff: date, tenant_id: int | None = None,
            model: str = BASE) -> None:
        with ctx.session_factory() as s:
            set_price(session=s, base_model=model, priority=priority, token_kind=kind, micros_per_mtok=micros,
                      effective_from=eff, tenant_id=tenant_id)
        self.entries = [e for e in self.entries if e[:5] != (tenant_id, model, priority, kind, eff)]
        self.entries.append((tenant_id, model, priority, kind, eff, micros))

    def lookup(self, tenant_id: int, model: str, priority: str, kind: str, day: date) -> int | None:
        def best(candidates):
            c = [e for e in candidates if e[4] <= day]
            return max(c, key=lambda e: e[4])[5] if c else None

        mine = [e for e in self.entries if e[0] == tenant_id and e[1:4] == (model, priority, kind)]
        book = [e for e in self.entries if e[0] is None and e[1:4] == (model, priority, kind)]
        contract = best(mine)
        return contract if contract is not None else best(book)

    def amount(self, e: Ev) -> int | None:
        day = e.at.astimezone(timezone.utc).date()
        pi = self.lookup(e.tenant_id, e.base_model, e.priority, "input", day)
        po = self.lookup(e.tenant_id, e.base_model, e.priority, "output", day)
        pc = self.lookup(e.tenant_id, e.base_model, e.priority, "cached_input", day)
        pc = pi if pc is None else pc  # no cached_input price: cached tokens cost the input price
        if pi is None or po is None:
            return None
        return (e.prompt - e.cached) * pi + e.cached * pc + e.completion * po
