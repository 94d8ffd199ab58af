"""The embedded database's transactions (tessera_core.db.make_engine on SQLite): a unit of work
that reads and then writes waits for another writer instead of failing, and a read-only session
neither waits for nor holds the write lock."""
from __future__ import annotations

import sqlite3
import threading
import time

from sqlalchemy import Column, Integer, MetaData, Table, insert, select

from tessera_core.db import make_engine, make_session_factory, read_only_session

META = MetaData()
ROWS = Table("rows", META, Column("id", Integer, primary_key=True), Column("n", Integer))


def database(tmp_path):
    path = tmp_path / "t.db"
    engine = make_engine(f"sqlite:///{path}")
    META.create_all(engine)
    return path, make_session_factory(engine)


def hold_write_lock(path, seconds: float) -> threading.Thread:
    """Another connection holding the write lock (a pending write) for `seconds`, in a thread."""
    taken = threading.Event()

    def run():
        c = sqlite3.connect(path, isolation_level=None)
        c.execute("BEGIN IMMEDIATE")
        c.execute("INSERT INTO rows (n) VALUES (-1)")
        taken.set()
        time.sleep(seconds)
        c.execute("COMMIT")
        c.close()

    t = threading.Thread(target=run)
    t.start()
    assert taken.wait(10)
    return t


def test_a_read_then_write_waits_for_another_writer_and_commits(tmp_path):
    path, sessions = database(tmp_path)
    holder = hold_write_lock(path, 0.5)
    with sessions() as s:  # read first, then write: the shape of an admin change
        before = s.scalar(select(ROWS.c.n).where(ROWS.c.n == 7))
        s.execute(insert(ROWS).values(n=7))
        s.commit()
    holder.join()
    assert before is None
    with sessions() as s:
        assert sorted(s.scalars(select(ROWS.c.n))) == [-1, 7]


def can_take_write_lock(path) -> bool:
    other = sqlite3.connect(path, isolation_level=None, timeout=0)
    try:
        other.execute("BEGIN IMMEDIATE")
        other.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        other.close()


def test_a_read_only_session_reads_beside_a_writer_and_leaves_the_lock_free(tmp_path):
    path, sessions = database(tmp_path)
    with sessions() as s:
        s.execute(insert(ROWS).values(n=1))
        s.commit()
    holder = hold_write_lock(path, 0.3)
    with read_only_session(sessions) as s:  # reads at once, beside the holder's pending write
        assert list(s.scalars(select(ROWS.c.n))) == [1]
    holder.join()

    with read_only_session(sessions) as s:  # an open read-only transaction leaves the write lock free
        s.scalars(select(ROWS.c.n)).all()
        assert can_take_write_lock(path)
    with sessions() as s:  # an ordinary one holds it from its first statement
        s.scalars(select(ROWS.c.n)).all()
        assert not can_take_write_lock(path)
