"""Nothing billed is lost: the meter against real databases made to fail (a SQLite write lock held
past the busy timeout; Postgres connections killed and refused), then recovering. Events that
could not be written wait in the durable outbox and reach the database once, with the usage they
carried; the outbox survives a meter restart and a process killed right after recording."""
from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import textwrap
import uuid
from contextlib import contextmanager

import anyio
import psycopg2
import pytest
from sqlalchemy import create_engine, event, select

from adapter_registry.migrate import upgrade
from adapter_registry.settings import RegistrySettings
from tessera import services
from tessera.metering import Meter, Usage
from tessera.models import UsageEvent
from tessera_core.db import make_engine, make_session_factory

from ..adapter_registry.conftest import PG_ADMIN, create_pg_database, drop_pg_database


def make_tenant(url: str) -> int:
    engine = make_engine(url)
    with make_session_factory(engine)() as s:
        services.upsert_plan(session=s, name="outbox-test")
        tid = services.create_tenant(session=s, name="t-" + uuid.uuid4().hex[:10], plan="outbox-test").id
    engine.dispose()
    return tid


def short_busy_timeout(url: str):
    """The gateway's SQLite engine with a 50 ms busy timeout instead of 30 s: the lock timeout of
    an insert is reached quickly."""
    engine = make_engine(url)
    event.listen(engine, "connect", lambda conn, _record: conn.execute("PRAGMA busy_timeout=50"))
    return engine


def meter_on(engine, **kw) -> Meter:
    """A meter recording through this engine (kw: outbox_dir, observer)."""
    return Meter(engine, make_session_factory(engine), **kw)


@contextmanager
def write_locked(url: str):
    """Another writer holds the SQLite database (past the busy timeout) for the block."""
    holder = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        yield
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def record_while_locked(url: str, meter: Meter, *events: Usage) -> list[bool]:
    """meter.record of each event while another writer holds the SQLite database."""
    with write_locked(url):
        return [anyio.run(meter.record, u) for u in events]


def usage(tenant_id: int, prompt: int, completion: int, request_id: str | None = None) -> Usage:
    return Usage(request_id=request_id or "req-" + uuid.uuid4().hex, tenant_id=tenant_id, api_key_id=None,
                 model="base", adapter_version=None, priority="standard", prompt_tokens=prompt,
                 completion_tokens=completion, status="completed", finish_reason="stop", ttft_ms=1.0,
                 duration_ms=2.0, base_model="base")


def stored(url: str, tenant_id: int) -> dict[str, int]:
    """request id -> prompt + completion tokens of the tenant's usage events in the database."""
    engine = create_engine(url)
    with engine.connect() as c:
        rows = c.execute(select(UsageEvent.request_id, UsageEvent.prompt_tokens + UsageEvent.completion_tokens)
                         .where(UsageEvent.tenant_id == tenant_id)).all()
    engine.dispose()
    return dict(rows)


def outbox_files(directory) -> list[str]:
    return sorted(p.name for p in directory.glob("usage-outbox-*.sqlite"))


class Observed:
    """An observer recording every request it is shown (what Prometheus would count)."""

    def __init__(self):
        self.seen: list[str] = []

    async def __call__(self, u: Usage) -> None:
        self.seen.append(u.request_id)


@pytest.fixture
def sqlite_db(tmp_path):
    url = f"sqlite:///{tmp_path}/tessera.db"
    upgrade(RegistrySettings(database_url=url))
    return url


@pytest.fixture
def locked(sqlite_db, tmp_path):
    """A meter on the 50 ms busy timeout engine (its outbox in tmp_path / "outbox"): a write lock
    held by another connection sends its events to the outbox at once."""
    engine = short_busy_timeout(sqlite_db)
    yield meter_on(engine, outbox_dir=tmp_path / "outbox")
    engine.dispose()


@pytest.fixture
def pg_db():
    url = create_pg_database()
    upgrade(RegistrySettings(database_url=url))
    yield url
    set_connections(url, allowed=True)
    drop_pg_database(url)


def set_connections(url: str, *, allowed: bool) -> None:
    """Refuse (and kill) or allow again every connection to this Postgres database."""
    name = url.rsplit("/", 1)[1]
    conn = psycopg2.connect(connect_timeout=3, **PG_ADMIN)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {str(allowed).lower()}')
        if not allowed:
            cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
    conn.close()


def test_lock_timeout_defers_to_the_outbox_and_the_drain_records_each_event_once(sqlite_db, tmp_path):
    tid = make_tenant(sqlite_db)
    engine = short_busy_timeout(sqlite_db)
    observed = Observed()
    meter = meter_on(engine, observer=observed, outbox_dir=tmp_path / "outbox")
    sent = {}

    def record(u: Usage) -> bool:
        sent[u.request_id] = u.prompt_tokens + u.completion_tokens
        return anyio.run(meter.record, u)

    assert record(usage(tid, 5, 7))
    assert outbox_files(tmp_path / "outbox") == []  # nothing on disk while the database takes events

    with write_locked(sqlite_db):
        deferred = [usage(tid, 3 + i, 11 * i) for i in range(5)]
        assert not any(record(u) for u in deferred)
        again = usage(tid, 3, 0, request_id=deferred[0].request_id)  # a retried write of the same request
        assert not anyio.run(meter.record, again)
        assert meter.outbox_depth == 6 and len(outbox_files(tmp_path / "outbox")) == 1
        with pytest.raises(Exception):
            meter.drain_once()  # still locked: nothing moves, nothing is dropped
        assert meter.outbox_depth == 6

    meter.drain_once()
    assert meter.outbox_depth == 0
    assert stored(sqlite_db, tid) == sent  # every event once, with the tokens it carried
    assert meter.drain_once() == 0 and stored(sqlite_db, tid) == sent
    assert observed.seen == [r for r in sent] + [again.request_id]  # each observed when it happened
    meter.close()
    assert outbox_files(tmp_path / "outbox") == []  # an emptied outbox is removed
    engine.dispose()


def test_a_writer_holding_sqlite_does_not_stop_the_event_loop(sqlite_db, tmp_path):
    """The embedded gateway inserts each usage event inline on its event loop; while another
    connection holds SQLite's write lock (a billing rollup's transaction, an admin change) the
    insert must not wait there, which would freeze every stream the loop serves. The loop keeps
    running, and the event is recorded in the database (not the outbox) once the lock is released."""
    tid = make_tenant(sqlite_db)
    engine = make_engine(sqlite_db)  # the gateway's engine: a 30 s busy timeout
    meter = meter_on(engine, outbox_dir=tmp_path / "outbox")
    event_ = usage(tid, 6, 9)
    holder = sqlite3.connect(sqlite_db.removeprefix("sqlite:///"), isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    ticks = 0

    async def main() -> bool:
        nonlocal ticks
        done, result = anyio.Event(), {}

        async def record():
            result["inserted"] = await meter.record(event_)
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(record)
            for _ in range(20):  # the loop's other work: 20 ticks of 10 ms while the lock is held
                await anyio.sleep(0.01)
                ticks += 1
            waited = not done.is_set()
            holder.execute("COMMIT")
            with anyio.fail_after(10):
                await done.wait()
        return waited and result["inserted"]

    try:
        assert anyio.run(main)
    finally:
        holder.close()
    assert ticks == 20
    assert stored(sqlite_db, tid) == {event_.request_id: 15} and meter.outbox_depth == 0
    assert anyio.run(meter.record, usage(tid, 1, 1))  # and the inline insert serves the next one
    meter.close()
    conns = [engine.raw_connection() for _ in range(3)]  # every pooled connection (the meter's too) waits as before
    assert [c.driver_connection.execute("PRAGMA busy_timeout").fetchone()[0] for c in conns] == [30000] * 3
    for c in conns:
        c.close()
    engine.dispose()


def test_postgres_outage_and_a_meter_restart_with_a_pending_outbox(pg_db, tmp_path):
    tid = make_tenant(pg_db)
    outbox = tmp_path / "outbox"
    engine = make_engine(pg_db)
    meter = meter_on(engine, outbox_dir=outbox)
    sent = {}

    def record(u: Usage) -> bool:
        sent[u.request_id] = u.prompt_tokens + u.completion_tokens
        return anyio.run(meter.record, u)

    assert record(usage(tid, 4, 4))
    set_connections(pg_db, allowed=False)  # the pooled connection is killed, new ones refused
    for i in range(4):
        assert not record(usage(tid, 10, i))
    assert meter.outbox_depth == 4
    meter.close()  # the gateway stops before the database is back
    engine.dispose()
    assert len(outbox_files(outbox)) == 1

    set_connections(pg_db, allowed=True)
    engine = make_engine(pg_db)
    restarted = meter_on(engine, outbox_dir=outbox)

    async def run_drainer_until_empty():
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: restarted.drain_outbox(retry_min_s=0.05, retry_max_s=0.2))
                while not outbox_files(outbox) == []:  # the adopted outbox is deleted once drained
                    await anyio.sleep(0.05)
                tg.cancel_scope.cancel()

    anyio.run(run_drainer_until_empty)
    assert stored(pg_db, tid) == sent and sum(stored(pg_db, tid).values()) == 8 + 10 + 11 + 12 + 13
    restarted.close()
    engine.dispose()


def test_an_event_the_database_refuses_is_kept_not_retried_forever(sqlite_db, tmp_path, locked):
    tid = make_tenant(sqlite_db)
    engine = make_engine(sqlite_db)
    meter = meter_on(engine, outbox_dir=tmp_path / "outbox")
    good, bad = usage(tid, 1, 2), usage(tid + 1000, 1, 2)  # no such tenant: a foreign key refuses it
    assert record_while_locked(sqlite_db, locked, good, bad) == [False, False]
    locked.drain_once()
    assert locked.outbox_depth == 0 and stored(sqlite_db, tid) == {good.request_id: 3}
    locked.close()
    assert len(outbox_files(tmp_path / "outbox")) == 1  # the refused event stays on disk
    (path,) = (tmp_path / "outbox").glob("usage-outbox-*.sqlite")
    rows = sqlite3.connect(path).execute("SELECT request_id, rejected FROM events").fetchall()
    assert [r[0] for r in rows] == [bad.request_id] and "FOREIGN KEY" in rows[0][1].upper()
    meter.close()
    engine.dispose()


def test_outboxes_are_per_process_and_per_database(sqlite_db, tmp_path, locked):
    """A live meter's outbox is never adopted by another, nor one for another database."""
    tid = make_tenant(sqlite_db)
    assert record_while_locked(sqlite_db, locked, usage(tid, 1, 1)) == [False]

    other_db = f"sqlite:///{tmp_path}/other.db"
    upgrade(RegistrySettings(database_url=other_db))
    other = create_engine(other_db)
    assert meter_on(other, outbox_dir=tmp_path / "outbox").adopt_orphans() == 0
    second_engine = make_engine(sqlite_db)
    second = meter_on(second_engine, outbox_dir=tmp_path / "outbox")
    assert second.adopt_orphans() == 0  # the locked meter is alive and holds its outbox
    locked.close()
    assert second.adopt_orphans() == 1  # now it is an orphan
    second.drain_once()
    assert stored(sqlite_db, tid) != {} and outbox_files(tmp_path / "outbox") == []
    second.close()
    for e in (other, second_engine):
        e.dispose()


def test_an_event_survives_the_process_killed_right_after_recording(pg_db, tmp_path):
    tid = make_tenant(pg_db)
    outbox = tmp_path / "outbox"
    set_connections(pg_db, allowed=False)
    script = textwrap.dedent(f"""
        import os, signal, anyio
        from tessera.metering import Meter, Usage
        from tessera_core.db import make_engine, make_session_factory
        engine = make_engine({pg_db!r})
        meter = Meter(engine, make_session_factory(engine), outbox_dir={str(outbox)!r})
        u = Usage(request_id="req-killed", tenant_id={tid}, api_key_id=None, model="base", adapter_version=None,
                  priority="standard", prompt_tokens=12, completion_tokens=30, status="completed",
                  finish_reason="stop", ttft_ms=1.0, duration_ms=2.0)
        assert anyio.run(meter.record, u) is False
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    set_connections(pg_db, allowed=True)
    engine = make_engine(pg_db)
    meter = meter_on(engine, outbox_dir=outbox)
    assert meter.adopt_orphans() == 1
    meter.drain_once()
    assert stored(pg_db, tid) == {"req-killed": 42} and outbox_files(outbox) == []
    meter.close()
    engine.dispose()
