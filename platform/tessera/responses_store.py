"""Stored responses of the Responses API (tessera.models.StoredResponse): save, read, delete,
the conversation behind a `previous_response_id`, and retention.

Isolation: every read and delete takes the caller's tenant id and filters by it, so another
tenant's id is the same "not found" as an unknown one. Retention: a response older than
`retention_days` is not found either (whether or not a purge has deleted its row yet), and
`purge_expired` deletes such rows, and those of deleted tenants (whose keys are refused from
the moment they are deleted), in bounded batches: each save runs one small batch, so no timer
is needed; a periodic job may run more. A tenant row deleted outright takes its rows with it
(ON DELETE CASCADE). The same statements serve SQLite and Postgres.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from adapter_registry.models import Tenant
from tessera.models import StoredResponse
from tessera_core.db import utcnow

#: The most stored responses a `previous_response_id` chain may hold (its own included); a
#: longer one is a 400 (continue from a new conversation, or send the history as input).
MAX_CHAIN = 100
#: Rows one save's purge deletes at most: the request path never waits on a large delete.
PURGE_BATCH = 100


class ChainError(Exception):
    """A previous_response_id the caller cannot continue: `code` says why (not found, broken, too long)."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.message = message
        self.code = code


@dataclass(frozen=True)
class NewResponse:
    """One response to store: its row's columns."""

    id: str
    tenant_id: int
    api_key_id: int | None
    model: str
    status: str
    created_at: datetime
    previous_response_id: str | None
    instructions: str | None
    input_items: list
    output_items: list
    usage: dict | None
    metadata: dict
    params: dict


def _cutoff(retention_days: int, now: datetime | None = None) -> datetime:
    return (now or utcnow()) - timedelta(days=retention_days)


def as_utc(dt: datetime) -> datetime:
    """A stored timestamp as aware UTC (SQLite returns naive datetimes, written in UTC)."""
    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)


def save(*, session: Session, response: NewResponse, retention_days: int) -> None:
    """Insert `response`, then purge one batch (`purge_expired`); one commit."""
    r = response
    session.add(StoredResponse(id=r.id, tenant_id=r.tenant_id, api_key_id=r.api_key_id, model=r.model,
                               status=r.status, created_at=r.created_at, previous_response_id=r.previous_response_id,
                               instructions=r.instructions, input_items=r.input_items, output_items=r.output_items,
                               usage=r.usage, metadata_=r.metadata, params=r.params))
    session.flush()
    purge_expired(session=session, retention_days=retention_days, limit=PURGE_BATCH)
    session.commit()


def get(*, session: Session, tenant_id: int, response_id: str, retention_days: int) -> StoredResponse | None:
    """The tenant's stored response `response_id`, or None (unknown, another tenant's, expired)."""
    return session.scalar(select(StoredResponse).where(
        StoredResponse.id == response_id, StoredResponse.tenant_id == tenant_id,
        StoredResponse.created_at >= _cutoff(retention_days)))


def remove(*, session: Session, tenant_id: int, response_id: str, retention_days: int) -> bool:
    """Delete the tenant's stored response `response_id`; False if get() would not find it.
    Responses that continue it keep their own items; continuing them then fails (`history`)."""
    found = session.execute(delete(StoredResponse).where(
        StoredResponse.id == response_id, StoredResponse.tenant_id == tenant_id,
        StoredResponse.created_at >= _cutoff(retention_days))).rowcount
    session.commit()
    return bool(found)


def history(*, session: Session, tenant_id: int, response_id: str, retention_days: int,
            max_chain: int = MAX_CHAIN) -> list[dict]:
    """The conversation a new request continues from `response_id`: for each stored response of
    the chain, oldest first, its input items then its output items (instructions are not
    carried over, as OpenAI). Raises ChainError when `response_id` is not the tenant's (or
    expired), when a response of the chain was deleted or expired (the conversation would be
    silently cut), or when the chain holds more than `max_chain` responses."""
    chain: list[StoredResponse] = []
    wanted: str | None = response_id
    while wanted is not None:
        if len(chain) == max_chain:
            raise ChainError(f"the conversation behind previous_response_id holds more than {max_chain} responses; "
                             "start a new one (send the history you need as input)", "conversation_too_long")
        row = get(session=session, tenant_id=tenant_id, response_id=wanted, retention_days=retention_days)
        if row is None:
            if not chain:
                raise ChainError(f"previous response with id {response_id!r} not found", "previous_response_not_found")
            raise ChainError(f"previous response {chain[-1].id!r} continues {wanted!r}, which was deleted or has "
                             "expired: the conversation cannot be rebuilt", "previous_response_not_found")
        chain.append(row)
        wanted = row.previous_response_id
    items: list[dict] = []
    for row in reversed(chain):
        items.extend(row.input_items)
        items.extend(row.output_items)
    return items


def purge_expired(*, session: Session, retention_days: int, limit: int | None = None,
                  now: datetime | None = None) -> int:
    """Delete stored responses older than `retention_days`, then those of deleted tenants (at
    most `limit` rows of each when given); the caller commits. Returns how many were deleted."""
    return _purge_aged(session, retention_days, limit, now) + _purge_where(
        session, StoredResponse.tenant_id.in_(select(Tenant.id).where(Tenant.deleted_at.is_not(None))), limit)


def _purge_aged(session: Session, retention_days: int, limit: int | None, now: datetime | None = None) -> int:
    # Its own statement: created_at's index finds the rows (an OR with the tenants' clause would
    # scan the table on every save).
    return _purge_where(session, StoredResponse.created_at < _cutoff(retention_days, now), limit)


def _purge_where(session: Session, clause, limit: int | None) -> int:
    # Rows another transaction is purging are skipped (Postgres; SQLite has one writer anyway),
    # so concurrent saves never wait on, or deadlock over, the same expired rows.
    doomed = select(StoredResponse.id).where(clause).with_for_update(skip_locked=True)
    if limit is not None:
        doomed = doomed.limit(limit)
    ids = list(session.scalars(doomed))
    if not ids:
        return 0
    return session.execute(delete(StoredResponse).where(StoredResponse.id.in_(ids))).rowcount
