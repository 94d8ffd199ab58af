"""Usage metering: one usage event per request, keyed by its request id.

`record` inserts the event and commits before the response ends (the gateway awaits it before
sending the last bytes), so a finished response always has a durable event. Inserting the same
request id again keeps the first event (INSERT ... ON CONFLICT DO NOTHING on Postgres and SQLite),
which makes retries of the write safe.

`observer` (when given) sees every recorded request once, after the write: the gateway's
Prometheus metrics hook there (tessera.observability.metrics), so every request's latency and
tokens are counted from the same record that bills it.

Nothing billed is lost: when the insert fails (database down or restarting, connection killed,
lock timeout), the event is appended to this process's durable outbox (outbox.py) and the
response completes as usual; `drain_outbox`, a task of the gateway's lifespan, inserts the
outbox's events (those a previous process left behind too) with backoff and removes each one
only after its commit. A replay of an event that did reach the database is ignored (same request
id), so an insert that failed after its commit is still billed once. The happy path does no
outbox work: the outbox is touched only after a failed insert, and by the drainer. An outbox
event written before a field existed (cached_tokens) is recorded with that field's default.
"""
from __future__ import annotations

import logging
import sqlite3
import threading
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import anyio
from sqlalchemy import func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DataError, IntegrityError
from sqlalchemy.orm import sessionmaker

from tessera.billing.periods import Period
from tessera.models import UsageEvent
from tessera.observability.metrics import usage_outbox_metrics
from tessera.outbox import UsageOutbox, database_tag
from tessera_core.db import read_only_session, utcnow

log = logging.getLogger(__name__)
_SQLITE_BUSY = 5  # SQLite's primary result code for a lock held by another connection


@dataclass
class Usage:
    """What one request used. status: completed, aborted (client went away: prompt_tokens are
    those the engine prefilled before the abort, completion_tokens those sent; the rule is in
    docs/ARCHITECTURE.md, "A client that goes away") or error."""

    request_id: str
    tenant_id: int
    api_key_id: int | None
    model: str
    adapter_version: str | None
    priority: str
    prompt_tokens: int
    completion_tokens: int
    status: str
    finish_reason: str | None
    ttft_ms: float | None
    duration_ms: float
    base_model: str | None = None  # the base model that served it (billing prices by it)
    cached_tokens: int = 0  # of prompt_tokens, those served from the engine's prefix cache
    end_user: str | None = None  # the request's `user`, for the tenant's own reports
    safety_identifier: str | None = None  # the request's `safety_identifier`, likewise

    def __post_init__(self):
        # Billing charges prompt_tokens - cached_tokens at the input price: a count outside
        # [0, prompt_tokens] would bill a negative amount, so it is bounded here, where every
        # recorded request passes, and said in the log.
        bounded = min(max(self.cached_tokens, 0), self.prompt_tokens)
        if bounded != self.cached_tokens:
            log.warning("request %s: cached_tokens %r is outside [0, prompt_tokens=%d]; recorded as %d",
                        self.request_id, self.cached_tokens, self.prompt_tokens, bounded)
            self.cached_tokens = bounded


#: The Usage fields an event stored by an older gateway (an outbox file) may lack, with the value
#: they mean there: cached_tokens 0, base_model, end_user and safety_identifier unknown.
_FIELD_DEFAULTS = {f.name: f.default for f in fields(Usage) if f.default is not MISSING}


def _complete(values: dict) -> dict:
    """An outbox event as a full usage_events row: a field it predates gets its default (one
    insert of many rows needs the same keys in every row)."""
    for name, default in _FIELD_DEFAULTS.items():
        values.setdefault(name, default)
    return values


def used_in_month(session_factory: sessionmaker, *, tenant_id: int, month: Period) -> int:
    """Tokens (prompt + completion) the tenant's usage events record since the start of `month`
    (a UTC month, as quota.month_of gives it): what its monthly budget counter starts from.
    Blocking (run it off the event loop); raises SQLAlchemyError when the database fails."""
    since = month.start_datetime()
    with read_only_session(session_factory) as session:
        return int(session.scalar(
            select(func.coalesce(func.sum(UsageEvent.prompt_tokens + UsageEvent.completion_tokens), 0))
            .where(UsageEvent.tenant_id == tenant_id, UsageEvent.created_at >= since)))


class Meter:
    """Writes usage events (see `record`); events the database cannot take wait in a durable
    outbox under `outbox_dir` until `drain_outbox` moves them in (see the module docstring)."""

    def __init__(self, engine: Engine, session_factory: sessionmaker, observer=None, *, outbox_dir: Path):
        self.engine = engine
        self.session_factory = session_factory
        self.observer = observer  # async callable(usage), e.g. GatewayMetrics.observe
        insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert
        self.inline = engine.dialect.name == "sqlite"
        self._stmt = insert(UsageEvent).on_conflict_do_nothing(index_elements=[UsageEvent.request_id])
        self._sqlite: _SQLiteInsert | None = _SQLiteInsert(engine, self._stmt) if self.inline else None
        self.outbox_dir = Path(outbox_dir)
        self._tag = database_tag(engine.url)
        self._outbox: UsageOutbox | None = None  # this process's own, made on the first deferred event
        self._adopted: list[UsageOutbox] = []  # left by processes that died, being drained
        self._boxes_lock = threading.Lock()
        self._deferred_total, self._depth_gauge = usage_outbox_metrics()

    def record_sync(self, usage: Usage) -> bool:
        """Insert the event and commit; False if one with this request id already exists.
        Waits for the database's write lock (SQLite: its busy timeout) when another writer holds it."""
        if self._sqlite is not None:
            try:
                return self._sqlite.insert(usage)
            except WriterBusy:
                pass
        return self._insert_pooled(usage)

    def _insert_pooled(self, usage: Usage) -> bool:
        # Core on a plain connection: a quarter of the cost of an ORM session per event.
        with self.engine.begin() as conn:
            return conn.execute(self._stmt, dict(vars(usage))).rowcount == 1

    def close(self) -> None:
        """Release the database connection and the outbox files (an empty one is deleted; one
        with events left is adopted by the next gateway on this database)."""
        if self._sqlite is not None:
            self._sqlite.close()
        with self._boxes_lock:
            for box in [self._outbox, *self._adopted]:
                if box is not None:
                    box.close()
            self._outbox, self._adopted = None, []

    async def record(self, usage: Usage) -> bool:
        """`record_sync`, shielded so a cancelled request still gets its event. On SQLite (embedded,
        WAL, one process writing) the insert is far cheaper than a hop to a worker thread, so it
        runs inline, unless another writer holds the database (a billing rollup, an admin change):
        the inline insert does not wait for it (that would stop every stream the event loop serves
        for as long as the other transaction lasts), the event is inserted from a worker thread
        that waits. On Postgres it runs on a worker thread (network round trips).
        If the insert fails the event goes to the outbox (durable when this returns) and True is
        not returned; the observer still sees the request, once."""
        with anyio.CancelScope(shield=True):
            try:
                if self.inline:
                    try:
                        inserted = self._sqlite.insert(usage)
                    except WriterBusy:
                        inserted = await anyio.to_thread.run_sync(self._insert_pooled, usage)
                else:
                    inserted = await anyio.to_thread.run_sync(self.record_sync, usage)
            except Exception as e:  # noqa: BLE001 - the database's failure must not fail the response
                inserted = None  # the request happened: deferred to the outbox, and still observed
                await anyio.to_thread.run_sync(self._defer, usage, e)
            if self.observer is not None and inserted is not False:
                try:
                    await self.observer(usage)
                except Exception:  # noqa: BLE001 - metrics must never fail a response
                    log.warning("could not observe request %s", usage.request_id, exc_info=True)
            return bool(inserted)

    def _defer(self, usage: Usage, error: Exception) -> None:
        values = dict(vars(usage))
        values["created_at"] = utcnow()  # when it happened, not when the database takes it
        try:
            with self._boxes_lock:
                if self._outbox is None:
                    self._outbox = UsageOutbox.create(self.outbox_dir, self._tag)
                box = self._outbox
            box.append(values)
        except Exception:  # noqa: BLE001 - nowhere left to keep it: say so as loudly as we can
            log.exception("usage of request %s is LOST (tenant %s, %d+%d tokens): the database refused it (%s) "
                          "and the outbox in %s could not store it", usage.request_id, usage.tenant_id,
                          usage.prompt_tokens, usage.completion_tokens, _summary(error), self.outbox_dir)
            return
        self._deferred_total.inc()
        depth = self.outbox_depth
        self._depth_gauge.set(depth)
        # One warning when an outage starts (the drainer reports while it lasts), not one per request.
        log.log(logging.WARNING if depth == 1 else logging.DEBUG, "usage of request %s deferred to the outbox %s (%s)",
                usage.request_id, box.path, _summary(error))

    @property
    def outbox_depth(self) -> int:
        """Events waiting in the outboxes this process holds (its own and adopted ones)."""
        return sum(box.depth for box in [self._outbox, *self._adopted] if box is not None)

    def adopt_orphans(self) -> int:
        """Take over the outbox files that dead processes left for this database; events found."""
        found = UsageOutbox.adopt_orphans(self.outbox_dir, self._tag)
        with self._boxes_lock:
            self._adopted.extend(found)
        self._depth_gauge.set(self.outbox_depth)
        return sum(box.depth for box in found)

    def drain_once(self, batch: int = 500) -> int:
        """Move up to `batch` events from each outbox into the database, each outbox's batch in
        one transaction, removing them from the outbox after its commit; the number moved.
        Raises the database's error when it is unavailable (the events stay). An event the
        database refuses (a constraint, bad data) is kept in the outbox as rejected, logged."""
        moved = 0
        with self._boxes_lock:
            boxes = [b for b in [self._outbox, *self._adopted] if b is not None]
        for box in boxes:
            events = [(i, _complete(values)) for i, values in box.peek(batch)]
            if not events:
                continue
            try:
                with self.engine.begin() as conn:
                    conn.execute(self._stmt, [values for _, values in events])
            except (IntegrityError, DataError):  # one of them is refused: find it, move the rest
                self._drain_one_by_one(box, events)
            else:
                box.remove([i for i, _ in events])
            moved += len(events)
        with self._boxes_lock:
            done = [b for b in self._adopted if b.depth == 0]
            self._adopted = [b for b in self._adopted if b.depth != 0]
        for box in done:
            box.close()  # deleted unless it keeps rejected events
        self._depth_gauge.set(self.outbox_depth)
        return moved

    def _drain_one_by_one(self, box: UsageOutbox, events: list[tuple[int, dict]]) -> None:
        for outbox_id, values in events:
            try:
                with self.engine.begin() as conn:
                    conn.execute(self._stmt, values)
            except (IntegrityError, DataError) as e:
                box.reject(outbox_id, _summary(e))
                log.error("usage of request %s refused by the database (%s); kept in %s as rejected",
                          values.get("request_id"), _summary(e), box.path)
            else:
                box.remove([outbox_id])

    async def drain_outbox(self, *, retry_min_s: float = 0.5, retry_max_s: float = 30.0) -> None:
        """Run until cancelled (a task of the gateway's lifespan): adopt what dead processes left,
        then move outbox events into the database whenever there are some, checking every
        `retry_min_s`; while the database fails, wait from `retry_min_s` doubling up to
        `retry_max_s` between attempts."""
        try:
            found = await anyio.to_thread.run_sync(self.adopt_orphans)
            if found:
                log.warning("usage outbox: %d events left by a previous process, to be recorded", found)
        except Exception:  # noqa: BLE001 - a bad outbox directory must not stop the gateway
            log.exception("usage outbox: could not look for outboxes left in %s", self.outbox_dir)
        delay = retry_min_s
        while True:
            if self.outbox_depth == 0:
                await anyio.sleep(retry_min_s)
                continue
            try:
                moved = await anyio.to_thread.run_sync(self.drain_once)
            except Exception as e:  # noqa: BLE001 - the database is still away: keep them, retry
                log.warning("usage outbox: %d events wait for the database (%s); next try in %.1fs",
                            self.outbox_depth, _summary(e), delay)
                await anyio.sleep(delay)
                delay = min(delay * 2, retry_max_s)
                continue
            delay = retry_min_s
            if moved:
                log.info("usage outbox: %d events recorded, %d waiting", moved, self.outbox_depth)


def _summary(error: Exception) -> str:
    first = str(getattr(error, "orig", None) or error).strip().splitlines()
    return f"{type(error).__name__}: {first[0] if first else ''}"[:300]


class WriterBusy(Exception):
    """The embedded usage insert found another connection holding SQLite's write lock."""


class _SQLiteInsert:
    """The embedded mode's usage insert on one dedicated SQLite connection: the statement that
    SQLAlchemy compiled for `stmt` (same SQL, same column conversions, the engine's connect-time
    pragmas), executed in SQLite's autocommit mode, where the single INSERT is its own durable
    transaction. It is on every response's critical path (the event must be durable before the
    last bytes go out), and a pooled connection plus BEGIN/COMMIT round trips would cost more than
    the insert itself (bench/RESULTS.md, gateway). Its connection never waits for the write lock
    (busy timeout 0): `insert` raises WriterBusy at once while another transaction writes, and the
    caller inserts through a pooled connection, which waits, off the event loop."""

    def __init__(self, engine: Engine, stmt):
        columns = [f.name for f in fields(Usage)] + ["created_at"]
        compiled = stmt.values({c: None for c in columns}).compile(dialect=engine.dialect)
        self.sql = str(compiled)
        self.order = list(compiled.positiontup)
        table = UsageEvent.__table__
        self.convert = {k: p for k in self.order
                        if (p := table.c[k].type.dialect_impl(engine.dialect).bind_processor(engine.dialect))}
        self._engine = engine
        self._fairy = None  # a pool connection kept for the meter's lifetime
        self._pool_busy_ms = 0  # its busy timeout as the pool gave it, restored when it goes back
        self._lock = threading.Lock()

    def insert(self, usage: Usage) -> bool:
        values = dict(vars(usage))  # flat fields: no deep copy (dataclasses.asdict's is 5% of a request)
        values["created_at"] = utcnow()
        params = [self.convert[k](values[k]) if k in self.convert else values[k] for k in self.order]
        with self._lock:
            if self._fairy is None:
                self._fairy = self._engine.raw_connection()
                driver = self._fairy.driver_connection
                self._pool_busy_ms = driver.execute("PRAGMA busy_timeout").fetchone()[0]
                driver.execute("PRAGMA busy_timeout = 0")
            conn = self._fairy.driver_connection
            if conn.in_transaction:  # never expected; a failed statement must not leave one open
                conn.rollback()
            try:
                return conn.execute(self.sql, params).rowcount == 1
            except sqlite3.OperationalError as e:
                if e.sqlite_errorcode & 0xFF == _SQLITE_BUSY:  # extended codes keep the primary in the low byte
                    raise WriterBusy(str(e)) from e
                raise

    def close(self) -> None:
        with self._lock:
            if self._fairy is not None:
                try:  # back to the pool with the wait its other users expect
                    self._fairy.driver_connection.execute(f"PRAGMA busy_timeout = {int(self._pool_busy_ms)}")
                except sqlite3.Error:
                    self._fairy.invalidate()  # closed rather than pooled as it is
                self._fairy.close()
                self._fairy = None
