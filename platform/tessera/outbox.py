"""The usage outbox: a local, durable queue of usage events the database could not take.

When a usage insert fails (database down or restarting, connection killed, lock timeout), the
meter (metering.py) appends the event here and the response still completes; the meter's drainer
moves the events into the database later and removes each one only after its commit.

One outbox file per gateway process, never shared: `usage-outbox-<db>-<pid>-<random>.sqlite`
under the configured directory, created on the first deferred event. `<db>` is a digest of the
database URL (without its password), so events are only ever replayed into the database they
were meant for. The process holds an exclusive flock on the file's `.lock` companion for its
whole life; the kernel releases it when the process dies, however it dies, so a file whose lock
can be taken belongs to nobody and is adopted (`adopt_orphans`) by the next gateway that starts
on the same database. The lock file is locked before the outbox file is created and deleted
after it, so an outbox file always has a lock file beside it.

Durability: each append is one SQLite transaction in WAL mode with synchronous=FULL, committed
(written and fsync'ed) before `append` returns, so an event survives the process being killed
right after, and a power loss after the commit. Events rejected by the database itself (a
constraint the event breaks, not an outage) are kept in the file, marked with the error, and
never retried: nothing is deleted that did not reach the database.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import sqlite3
import threading
import uuid
from datetime import datetime
from pathlib import Path

log = logging.getLogger(__name__)

_SCHEMA = """CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    request_id TEXT NOT NULL,
    event TEXT NOT NULL,          -- JSON object: the usage_events row (created_at ISO 8601)
    rejected TEXT                 -- NULL: pending; else the database's reason for refusing it
)"""


def database_tag(url: str) -> str:
    """A short digest naming the database `url` points at (the password is not part of it)."""
    from sqlalchemy.engine import make_url

    safe = make_url(url).set(password=None).render_as_string(hide_password=False)
    return hashlib.sha256(safe.encode()).hexdigest()[:12]


def encode(values: dict) -> str:
    """One usage_events row as outbox JSON (datetimes as ISO 8601 strings)."""
    return json.dumps({k: v.isoformat() if isinstance(v, datetime) else v for k, v in values.items()},
                      separators=(",", ":"))


def decode(text: str) -> dict:
    """The inverse of `encode`."""
    values = json.loads(text)
    if values.get("created_at") is not None:
        values["created_at"] = datetime.fromisoformat(values["created_at"])
    return values


class UsageOutbox:
    """One outbox file, held under its lock by this process (see the module docstring).

    Thread-safe: appends come from request handlers (worker threads), reads and removals from
    the drainer."""

    def __init__(self, path: Path, lock_fd: int):
        self.path = path
        self._lock_fd = lock_fd
        self._mutex = threading.Lock()
        self._conn = sqlite3.connect(f"file:{path}?mode=rwc", uri=True, isolation_level=None,
                                     check_same_thread=False)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.execute(_SCHEMA)
        self.depth = self._conn.execute("SELECT count(*) FROM events WHERE rejected IS NULL").fetchone()[0]

    @classmethod
    def create(cls, directory: Path, tag: str) -> "UsageOutbox":
        """A new outbox file for this process under `directory` (made if missing)."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"usage-outbox-{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}.sqlite"
        fd = os.open(_lock_path(path), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)  # a fresh name: nobody else has it, never blocks
        box = cls(path, fd)
        _fsync_dir(directory)  # the new file's name is durable too
        return box

    @classmethod
    def adopt_orphans(cls, directory: Path, tag: str) -> list["UsageOutbox"]:
        """The outbox files for database `tag` whose owning process is gone, now held by this one."""
        adopted = []
        for path in sorted(directory.glob(f"usage-outbox-{tag}-*.sqlite")):
            try:
                fd = os.open(_lock_path(path), os.O_RDWR)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a live process owns it
                os.close(fd)
                continue
            if not path.exists():  # another process adopted and emptied it just before us
                os.close(fd)
                continue
            try:
                adopted.append(cls(path, fd))
            except sqlite3.Error:
                log.exception("usage outbox %s cannot be read; left in place", path)
                os.close(fd)
        return adopted

    def append(self, values: dict) -> None:
        """Store one usage_events row durably (committed and fsync'ed when this returns)."""
        with self._mutex:
            self._conn.execute("INSERT INTO events (request_id, event) VALUES (?, ?)",
                               (values["request_id"], encode(values)))
            self.depth += 1

    def peek(self, limit: int) -> list[tuple[int, dict]]:
        """Up to `limit` pending events, oldest first, as (outbox id, usage_events row)."""
        with self._mutex:
            rows = self._conn.execute("SELECT id, event FROM events WHERE rejected IS NULL ORDER BY id LIMIT ?",
                                      (limit,)).fetchall()
        return [(i, decode(e)) for i, e in rows]

    def remove(self, ids: list[int]) -> None:
        """Forget events that are committed in the database."""
        with self._mutex:
            self._conn.execute("BEGIN")
            removed = self._conn.executemany("DELETE FROM events WHERE id = ? AND rejected IS NULL",
                                             [(i,) for i in ids]).rowcount
            self._conn.execute("COMMIT")
            self.depth -= removed

    def reject(self, outbox_id: int, reason: str) -> None:
        """Keep an event the database refused (for an operator), out of the pending ones."""
        with self._mutex:
            self._conn.execute("UPDATE events SET rejected = ? WHERE id = ? AND rejected IS NULL",
                               (reason[:2000], outbox_id))
            self.depth -= 1

    def rejected(self) -> int:
        """How many events the database refused (kept in the file)."""
        with self._mutex:
            return self._conn.execute("SELECT count(*) FROM events WHERE rejected IS NOT NULL").fetchone()[0]

    def close(self) -> None:
        """Close the file and release its lock; an outbox with nothing left in it is deleted."""
        with self._mutex:
            empty = self._conn.execute("SELECT count(*) FROM events").fetchone()[0] == 0
            self._conn.close()
            if empty:
                for suffix in ("", "-wal", "-shm"):
                    Path(f"{self.path}{suffix}").unlink(missing_ok=True)
                Path(_lock_path(self.path)).unlink(missing_ok=True)
            os.close(self._lock_fd)


def _lock_path(path: Path) -> str:
    return f"{path}.lock"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
