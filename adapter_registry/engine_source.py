"""The registry's implementation of the engine's AdapterSource protocol.

`RegistryAdapterSource.fetch(version_id)` takes a version's sha256 (hex) and returns a local
directory holding adapter_config.json + adapter_model.safetensors of that version:
- cached on disk under `<cache_dir>/<sha256>/`: a hit costs a stat, no database or store call;
- downloaded from the object store into a temp dir, each file's sha256 checked against the
  database and the pair against the version digest, then renamed into place (atomic: readers
  never see a half-written version);
- concurrent fetches of one version are coalesced: threads of one process wait on one lock per
  version, and processes sharing the cache dir on a file lock, so it is downloaded once.
Only 'ready', undeleted versions are served. A source bound to a tenant serves only that
tenant's versions (the same bytes uploaded by two tenants are two versions with one digest).

`report_fault(version_id, reason)` is the engine's way back: a version whose use produced
non-finite numbers is quarantined (services.quarantine_version), so no request gets it again.
"""
from __future__ import annotations

import fcntl
import logging
import shutil
import tempfile
import threading
import time
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import sessionmaker

from adapter_registry.content import sha256_file, version_digest
from adapter_registry.models import Adapter, AdapterVersion
from engine.lora.source import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterFetchError, check_version_id
from tessera_core.db import read_only_session
from tessera_core.errors import ObjectNotFound, TesseraError
from tessera_core.objectstore import ObjectStore

log = logging.getLogger(__name__)
#: Tries of a quarantine write before report_fault gives up (logged).
QUARANTINE_ATTEMPTS = 5


class RegistryAdapterSource:
    """AdapterSource over the registry database and object store (see module docstring)."""

    def __init__(self, *, session_factory: sessionmaker, store: ObjectStore, cache_dir: str | Path,
                 tenant_id: int | None = None):
        self.session_factory = session_factory
        self.store = store
        self.cache_dir = Path(cache_dir)
        self.tenant_id = tenant_id
        self.downloads = 0  # versions downloaded by this source (cache misses), for metrics
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def _lock_for(self, version_id: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(version_id, threading.Lock())

    def _is_cached(self, path: Path) -> bool:
        return (path / ADAPTER_CONFIG).is_file() and (path / ADAPTER_WEIGHTS).is_file()

    def fetch(self, version_id: str) -> Path:
        """Local directory of version `version_id` (a sha256 hex); AdapterFetchError if the version
        is unknown, not ready, another tenant's, unreachable, or fails its checksum."""
        check_version_id(version_id)
        if len(version_id) != 64 or any(c not in "0123456789abcdef" for c in version_id):
            raise AdapterFetchError(f"adapter version id {version_id!r} is not a sha256 hex digest")
        final = self.cache_dir / version_id
        version = self._lookup(version_id)  # checks ready + tenant even when cached
        if self._is_cached(final):
            return final
        with self._lock_for(version_id):
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            with open(self.cache_dir / f".{version_id}.lock", "w") as lockfile:
                fcntl.flock(lockfile, fcntl.LOCK_EX)
                try:
                    if self._is_cached(final):  # another thread/process finished it meanwhile
                        return final
                    self._download(version, final)
                    return final
                finally:
                    fcntl.flock(lockfile, fcntl.LOCK_UN)

    def report_fault(self, version_id: str, reason: str) -> None:
        """Quarantine version `version_id` (a sha256 hex) with `reason`: every ready version with
        that digest, whichever tenant's, stops being resolved and fetched, and adapters pointing
        at it fall back to their newest other ready version. Logs; never raises (the engine calls
        it off its step loop). A write that collides with another (SQLite's single writer; a
        Postgres serialization failure) is retried a few times with backoff before giving up."""
        from adapter_registry.errors import RegistryUnavailable
        from adapter_registry.services import quarantine_version

        delay = 0.1
        for attempt in range(1, QUARANTINE_ATTEMPTS + 1):
            try:
                with self.session_factory() as session:
                    n = quarantine_version(session=session, sha256=str(version_id), reason=str(reason))
                log.warning("adapter version %s quarantined (%d version rows): %s", version_id, n, reason)
                return
            except RegistryUnavailable:
                if attempt == QUARANTINE_ATTEMPTS:
                    log.exception("could not quarantine adapter version %s (%s)", version_id, reason)
                    return
                time.sleep(delay)
                delay *= 2
            except Exception:  # noqa: BLE001 - never raise into the engine
                log.exception("could not quarantine adapter version %s (%s)", version_id, reason)
                return

    def _lookup(self, version_id: str) -> AdapterVersion:
        q = (select(AdapterVersion).join(Adapter, AdapterVersion.adapter_id == Adapter.id)
             .where(AdapterVersion.sha256 == version_id, AdapterVersion.status == "ready",
                    AdapterVersion.deleted_at.is_(None), Adapter.deleted_at.is_(None))
             .limit(1))
        if self.tenant_id is not None:
            q = q.where(Adapter.tenant_id == self.tenant_id)
        try:
            with read_only_session(self.session_factory) as session:  # never waits behind a writer
                version = session.scalar(q)
        except SQLAlchemyError as e:
            raise AdapterFetchError(f"adapter registry database unavailable ({type(e).__name__})") from e
        if version is None:
            raise AdapterFetchError(f"adapter version {version_id} not found or not ready")
        return version

    def _download(self, version: AdapterVersion, final: Path) -> None:
        tmp = Path(tempfile.mkdtemp(prefix=f".{version.sha256}.", dir=self.cache_dir))
        actual_sha: dict[str, str] = {}
        try:
            for key, name, expected in ((version.config_object_key, ADAPTER_CONFIG, version.config_sha256),
                                        (version.object_key, ADAPTER_WEIGHTS, version.weights_sha256)):
                try:
                    self.store.get_file(key, tmp / name)
                except ObjectNotFound:
                    raise AdapterFetchError(f"adapter version {version.sha256}: object {key} is missing from the store") from None
                except TesseraError as e:
                    raise AdapterFetchError(f"adapter version {version.sha256}: {e}") from e
                actual = actual_sha[name] = sha256_file(tmp / name)[0]
                if actual != expected:
                    raise AdapterFetchError(
                        f"adapter version {version.sha256}: {name} failed its checksum (sha256 {actual}, expected {expected})"
                    )
            digest = version_digest(actual_sha[ADAPTER_CONFIG], actual_sha[ADAPTER_WEIGHTS])
            if digest != version.sha256:
                raise AdapterFetchError(f"adapter version {version.sha256}: files hash to version {digest}")
            shutil.rmtree(final, ignore_errors=True)  # a stale partial dir from a crashed process
            tmp.rename(final)
            self.downloads += 1
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
