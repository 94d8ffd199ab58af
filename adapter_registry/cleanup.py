"""Garbage collection of what a failed upload can leave behind.

An upload puts objects before it writes rows, so a database failure can leave objects that no
blob row names; a failed validation start can leave blob rows no version uses. Both are removed
here once older than a grace period, which keeps in-flight uploads (objects stored, rows not yet
committed) safe. Run it periodically (the Celery task `adapter_registry.collect_garbage`).
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from sqlalchemy import delete, select, union
from sqlalchemy.orm import Session

from adapter_registry.content import BLOB_PREFIX
from adapter_registry.models import AdapterVersion, Blob
from tessera_core.db import utcnow
from tessera_core.objectstore import ObjectStore

DEFAULT_GRACE = timedelta(hours=1)


@dataclass(frozen=True)
class GarbageReport:
    orphan_objects_deleted: list[str]
    unused_blobs_deleted: list[str]


def _as_aware(dt: datetime) -> datetime:
    # SQLite returns naive datetimes for timezone=True columns; they were written in UTC.
    return dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)


def collect_garbage(*, session: Session, store: ObjectStore, grace: timedelta = DEFAULT_GRACE) -> GarbageReport:
    """Delete blob rows no version references and objects no blob row names, older than `grace`.

    Versions keep their blobs whatever their status or deletion (soft-deleted versions can be
    restored by re-uploading). Returns what was deleted.
    """
    cutoff = utcnow() - grace
    used = union(select(AdapterVersion.config_sha256), select(AdapterVersion.weights_sha256))
    unused = [b for b in session.scalars(select(Blob).where(Blob.sha256.not_in(used)))
              if _as_aware(b.created_at) < cutoff]
    for blob in unused:
        session.execute(delete(Blob).where(Blob.sha256 == blob.sha256))
    session.commit()  # rows first: an object without a row is garbage, a row without an object is not
    for blob in unused:
        store.delete(blob.object_key)

    known = set(session.scalars(select(Blob.object_key)))
    orphans = [o.key for o in store.list(BLOB_PREFIX) if o.key not in known and _as_aware(o.last_modified) < cutoff]
    for key in orphans:
        store.delete(key)
    return GarbageReport(orphan_objects_deleted=orphans, unused_blobs_deleted=[b.sha256 for b in unused])
