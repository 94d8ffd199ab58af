"""Database plumbing: the declarative Base every Tessera table shares, engines and sessions.

One MetaData for the registry's tables and the platform's (keys, plans, usage, billing), so one
Alembic history covers them all. A naming convention makes constraint names deterministic on
Postgres and SQLite alike, which migrations rely on.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone

from sqlalchemy import MetaData, create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    """Declarative base of every Tessera table (registry and platform)."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def utcnow() -> datetime:
    """Timezone-aware now, the default of every timestamp column."""
    return datetime.now(timezone.utc)


#: Execution option of a connection whose transaction only reads (see `read_only_session`).
READ_ONLY = "tessera_read_only"


def make_engine(url: str) -> Engine:
    """An Engine for `url`. SQLite gets foreign keys enforced and a busy timeout, so the embedded
    mode keeps the same integrity guarantees as Postgres.

    SQLite transactions begin IMMEDIATE (they take the write lock first, waiting up to the busy
    timeout for it) unless the connection is marked READ_ONLY. A deferred transaction that reads
    and then writes cannot wait: SQLite refuses its upgrade at once ("database is locked", no busy
    handler) whenever another connection holds the write lock, so an admin creating a tenant while
    a usage event was being written failed instead of waiting its turn."""
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _sqlite_connect(dbapi_conn, _record):
            # pysqlite's own transaction handling defers BEGIN and breaks SAVEPOINT; turn it off
            # and emit BEGIN ourselves (SQLAlchemy's documented recipe).
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn):
            conn.exec_driver_sql("BEGIN" if conn.get_execution_options().get(READ_ONLY) else "BEGIN IMMEDIATE")

        return engine
    # libpq options: a database that does not answer a connect within seconds is an outage (the
    # caller answers 503 or defers the write) rather than a request waiting on the OS's TCP
    # timeout; keepalives find a peer that vanished under an idle or running connection.
    libpq = {"connect_timeout": 5, "keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10,
             "keepalives_count": 3} if url.startswith("postgresql") else {}
    return create_engine(url, pool_pre_ping=True, pool_timeout=10, connect_args=libpq)


def make_session_factory(engine: Engine) -> sessionmaker:
    """Session factory; expire_on_commit=False so returned ORM objects stay readable after commit."""
    return sessionmaker(bind=engine, expire_on_commit=False)


@contextmanager
def read_only_session(session_factory: sessionmaker) -> Iterator[Session]:
    """A session for a unit of work that only reads. On SQLite its transaction begins deferred, so
    it never waits for the write lock nor holds it (readers on the request path, such as key and
    adapter lookups, run side by side); what it writes is refused whenever another connection
    writes. Elsewhere it is an ordinary session."""
    with session_factory() as session:
        begin_read_only(session)
        yield session


def begin_read_only(session: Session) -> None:
    """End `session`'s transaction (a rollback: the caller keeps nothing pending) and begin one
    that only reads, as `read_only_session`'s: on SQLite deferred, neither waiting for nor holding
    the write lock."""
    session.rollback()
    session.connection(execution_options={READ_ONLY: True})
