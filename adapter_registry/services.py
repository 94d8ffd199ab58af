"""Registry operations: tenants, adapter uploads, versions, the current pointer, soft deletion.

Every function is keyword-only and takes the caller's Session; every adapter operation takes the
tenant and only ever sees that tenant's rows (another tenant's adapter is NotFound, the same
message as a name that does not exist).

Upload protocol (nothing is left half-made):
1. stage the files locally and refuse unsafe/oversized uploads (no storage touched yet);
2. put content-addressed blobs in the object store (skipped for bytes already stored);
3. one transaction inserts blob rows, the adapter (if new) and a 'validating' version;
4. validation runs (in a bounded child process: validation.validate_in_sandbox; waited on inline
   in embedded mode, else by a Celery task) and marks it ready or rejected.
A store failure in 2 leaves no rows; a database failure in 3 leaves objects without rows, which
cleanup.collect_garbage removes after a grace period; a failure to start validation in 4 removes
the version again. The caller gets RegistryUnavailable (503) in each case.

A version left 'validating' by a process that died is found by `recover_stuck_versions` (run
when a gateway or worker starts) and validated again; re-uploading its bytes does the same. A
ready version the engine finds faulty is quarantined (`quarantine_version`): never served
again, its reason kept.
"""
from __future__ import annotations

import logging
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session

from adapter_registry import metrics
from adapter_registry.archive import ArchiveLimits, stage_upload
from adapter_registry.base_models import match_base_model
from adapter_registry.content import blob_key, sha256_file, version_digest
from adapter_registry.errors import (
    AdapterDoesNotFitBase,
    BaseModelRefused,
    Conflict,
    NameTaken,
    NotFound,
    QuotaExceeded,
    RegistryUnavailable,
)
from adapter_registry.models import Adapter, AdapterVersion, Blob, Tenant
from adapter_registry.names import check_identifier, identifier_key
from adapter_registry.settings import RegistrySettings
from adapter_registry.task_queue import STUCK_SLACK_S, send_validation
from adapter_registry.validation import AdapterRejected, base_of_upload, check_fits_base, validate_in_sandbox
from engine.lora.peft_format import BaseModelShape
from tessera_core.db import begin_read_only, utcnow
from tessera_core.errors import ObjectStoreError, Unavailable
from tessera_core.objectstore import ObjectStore

log = logging.getLogger(__name__)

_SHA = re.compile(r"^[0-9a-f]{64}$")


def _name_taken(session: Session, model, name: str, *, what: str, **scope) -> None:
    """NameTaken if a live row of `model` (within `scope`, e.g. tenant_id=) has `name` ignoring
    case under another spelling (adapter_registry.names: identifiers are unique ignoring case)."""
    q = select(model.name).where(func.lower(model.name) == identifier_key(name), model.name != name,
                                 model.deleted_at.is_(None), *(getattr(model, k) == v for k, v in scope.items()))
    other = session.scalar(q.limit(1))
    if other is not None:
        raise NameTaken(f"{what} {other!r} already exists; names are compared ignoring case, choose another name")


def _db_unavailable(e: SQLAlchemyError) -> RegistryUnavailable:
    return RegistryUnavailable(f"database unavailable ({type(e).__name__}); nothing was stored, try again")


@contextmanager
def _database_call(session: Session) -> Iterator[None]:
    """Run the block's database work; if the database fails, roll back and raise RegistryUnavailable."""
    try:
        yield
    except SQLAlchemyError as e:
        session.rollback()
        raise _db_unavailable(e) from e


# ---------------------------------------------------------------- tenants


def create_tenant(*, session: Session, name: str, max_adapters: int | None = None,
                  max_adapter_bytes: int | None = None) -> Tenant:
    """Create and commit a tenant. InvalidName (422) for a name outside the rule
    (adapter_registry.names), NameTaken (409) if a live tenant has the name, ignoring case."""
    check_identifier(name, what="tenant name")
    if session.scalar(select(Tenant.id).where(Tenant.name == name, Tenant.deleted_at.is_(None))) is not None:
        raise NameTaken(f"tenant {name!r} already exists")
    _name_taken(session, Tenant, name, what="tenant")
    tenant = Tenant(name=name, max_adapters=max_adapters, max_adapter_bytes=max_adapter_bytes)
    session.add(tenant)
    try:
        session.commit()
    except IntegrityError:  # a concurrent create of the same name (or a case variant) won
        session.rollback()
        raise NameTaken(f"tenant {name!r} already exists (created concurrently, maybe as a case variant)") from None
    return tenant


def get_tenant(*, session: Session, name: str | None = None, tenant_id: int | None = None) -> Tenant:
    """The live tenant with this name or id, else NotFound."""
    q = select(Tenant).where(Tenant.deleted_at.is_(None))
    q = q.where(Tenant.name == name) if name is not None else q.where(Tenant.id == tenant_id)
    tenant = session.scalar(q)
    if tenant is None:
        raise NotFound(f"tenant {name if name is not None else tenant_id!r} not found")
    return tenant


# ---------------------------------------------------------------- lookups (tenant-scoped)


def _adapter_or_none(session: Session, tenant: Tenant, name: str, *, lock: bool = False) -> Adapter | None:
    q = select(Adapter).where(Adapter.tenant_id == tenant.id, Adapter.name == name, Adapter.deleted_at.is_(None))
    if lock:
        q = q.with_for_update()
    return session.scalar(q)


def get_adapter(*, session: Session, tenant: Tenant, name: str) -> Adapter:
    """The tenant's live adapter `name`, else NotFound."""
    adapter = _adapter_or_none(session, tenant, name)
    if adapter is None:
        raise NotFound(f"adapter {name!r} not found")
    return adapter


def list_adapters(*, session: Session, tenant: Tenant) -> list[Adapter]:
    """The tenant's live adapters, by name."""
    return list(session.scalars(
        select(Adapter).where(Adapter.tenant_id == tenant.id, Adapter.deleted_at.is_(None)).order_by(Adapter.name)
    ))


def list_versions(*, session: Session, tenant: Tenant, name: str) -> list[AdapterVersion]:
    """The live versions of the tenant's adapter `name`, oldest first (any status)."""
    adapter = get_adapter(session=session, tenant=tenant, name=name)
    return list(session.scalars(
        select(AdapterVersion)
        .where(AdapterVersion.adapter_id == adapter.id, AdapterVersion.deleted_at.is_(None))
        .order_by(AdapterVersion.version)
    ))


#: The largest version number a reference can name: the database's integer column's range.
MAX_VERSION_NUMBER = 2**31 - 1


def parse_ref(ref: str) -> tuple[str, str | None]:
    """Split `name` or `name@version` (version: a number in ASCII digits from 0 to
    MAX_VERSION_NUMBER, or a 64-hex sha256). Any other version (Unicode digits that int() would
    read, a number past the range) is NotFound, as an unknown version is."""
    name, sep, version = ref.partition("@")
    number = version.isascii() and version.isdigit() and len(version) <= 10 and int(version) <= MAX_VERSION_NUMBER
    if sep and not (number or _SHA.fullmatch(version)):
        raise NotFound(f"invalid version {version[:80]!r} in {ref[:200]!r}: use name@<number> or name@<sha256>")
    return name, (version if sep else None)


def resolve_version(*, session: Session, tenant: Tenant, ref: str, require_ready: bool = True) -> AdapterVersion:
    """The version `ref` names within the tenant: `name` is the current version, `name@3` version
    3, `name@<sha256>` the version with that digest. With require_ready, a version that is not
    ready is a Conflict naming its status (and reason); an adapter with no current version is a
    Conflict too. Unknown or another tenant's: NotFound."""
    name, version = parse_ref(ref)
    adapter = get_adapter(session=session, tenant=tenant, name=name)
    if version is None:
        if adapter.current_version_id is None:
            newest = session.scalar(select(AdapterVersion).where(
                AdapterVersion.adapter_id == adapter.id, AdapterVersion.deleted_at.is_(None))
                .order_by(AdapterVersion.version.desc()).limit(1))
            if newest is None or newest.status == "validating":
                raise Conflict(f"adapter {name!r} has no ready version yet")
            reason = f": {newest.rejection_reason}" if newest.rejection_reason else ""
            raise Conflict(f"adapter {name!r} has no ready version; its newest, {newest.ref}, is {newest.status}{reason}")
        v = session.get(AdapterVersion, adapter.current_version_id)
    else:
        cond = AdapterVersion.sha256 == version if len(version) == 64 else AdapterVersion.version == int(version)
        v = session.scalar(select(AdapterVersion).where(
            AdapterVersion.adapter_id == adapter.id, AdapterVersion.deleted_at.is_(None), cond))
    if v is None or v.deleted_at is not None:
        raise NotFound(f"adapter version {ref!r} not found")
    if require_ready and v.status != "ready":
        reason = f": {v.rejection_reason}" if v.rejection_reason else ""
        raise Conflict(f"adapter version {v.ref} is {v.status}{reason}")
    return v


# ---------------------------------------------------------------- upload


def _limits_for(tenant: Tenant, settings: RegistrySettings) -> tuple[int, int]:
    max_bytes = tenant.max_adapter_bytes if tenant.max_adapter_bytes is not None else settings.default_max_adapter_bytes
    max_count = tenant.max_adapters if tenant.max_adapters is not None else settings.default_max_adapters
    return max_bytes, max_count


def _put_blob(session: Session, store: ObjectStore, sha: str, path: Path) -> None:
    # A committed blob row means the object is stored; otherwise (re)upload: content-addressed
    # puts of the same bytes are idempotent, and a concurrent uploader's object is identical.
    if session.get(Blob, sha) is None:
        store.put_file(blob_key(sha), path)


def _insert_blob(session: Session, sha: str, size: int) -> None:
    if session.get(Blob, sha) is not None:
        return
    try:
        with session.begin_nested():  # a concurrent upload of the same bytes may win the insert
            session.add(Blob(sha256=sha, object_key=blob_key(sha), size_bytes=size))
    except IntegrityError:
        pass


@metrics.count_uploads
def upload_adapter(*, session: Session, store: ObjectStore, settings: RegistrySettings, tenant: Tenant,
                   name: str, source: Path, base_model: str | None = None) -> AdapterVersion:
    """Store the adapter at `source` (folder, .zip or .tar.gz) as a new version of the tenant's
    adapter `name`, and validate it.

    Returns the version: 'ready' or 'rejected' (with its reason) when validation runs inline
    (settings.celery_eager; the calling thread waits on the validation child process), else
    'validating' until the worker is done; poll with `resolve_version(..., require_ready=False)`.
    Uploading bytes that already are a version of this adapter returns that version (a rejected
    or stuck one is validated again, a deleted one restored; a quarantined one stays quarantined).
    A version becomes current once ready unless a newer one already is.

    The base model is one of settings.served_base_models (what the engine serves, as it
    describes itself); the version records its name and description, which validation checks the
    files against wherever it runs.

    Raises UploadRejected (unsafe archive, pickle weights, missing files; BaseModelRefused when
    neither `base_model` nor the config names a served base model: validation.base_of_upload;
    AdapterDoesNotFitBase when the adapter's modules or tensor shapes are not the base's:
    validation.check_fits_base), QuotaExceeded (size or adapter count over the tenant's limits),
    Conflict (tenant suspended), RegistryUnavailable (no engine has described the served model
    yet; database, object store or task queue failed; nothing half-made remains).
    """
    check_identifier(name, what="adapter name")
    if tenant.status != "active":
        raise Conflict(f"tenant {tenant.name!r} is {tenant.status}; uploads are refused")
    if not settings.served_base_models:
        raise RegistryUnavailable("no engine has described the base model it serves yet, so adapters cannot be "
                                  "checked against it; nothing was stored, try again once an engine is up")
    max_bytes, max_count = _limits_for(tenant, settings)
    limits = ArchiveLimits(settings.archive_max_uncompressed_bytes, settings.archive_max_files)
    tenant_name = tenant.name  # read before the caller's transaction ends (no query for it later)
    # Staging, the reads and the object store puts below take seconds for a large upload: they run
    # in a transaction that only reads, which on SQLite holds no write lock (usage events, other
    # admins and the billing rollup go on meanwhile); the version is written in its own transaction.
    # The caller keeps nothing pending (like every writer here).
    with _database_call(session):
        begin_read_only(session)
    with tempfile.TemporaryDirectory(prefix="tessera-upload-") as work:
        staged = stage_upload(Path(source), Path(work), limits)
        weights_size = staged.weights_path.stat().st_size
        if weights_size > max_bytes:
            raise QuotaExceeded(
                f"adapter weights are {weights_size} bytes; tenant {tenant_name!r} may upload at most {max_bytes} bytes"
            )
        try:  # refused before anything is stored; the version records the served model
            base = base_of_upload(config_path=staged.config_path, base_model=base_model, settings=settings)
        except AdapterRejected as e:
            raise BaseModelRefused(str(e)) from None
        if base is not None:
            try:
                check_fits_base(config_path=staged.config_path, weights_path=staged.weights_path, base=base)
            except AdapterRejected as e:
                raise AdapterDoesNotFitBase(str(e)) from None
        config_sha, config_size = sha256_file(staged.config_path)
        weights_sha, weights_size = sha256_file(staged.weights_path)
        digest = version_digest(config_sha, weights_sha)

        try:
            adapter = _adapter_or_none(session, tenant, name)
            if adapter is None:
                _name_taken(session, Adapter, name, what="adapter", tenant_id=tenant.id)
                count = session.scalar(select(func.count(Adapter.id)).where(
                    Adapter.tenant_id == tenant.id, Adapter.deleted_at.is_(None)))
                if count >= max_count:
                    raise QuotaExceeded(f"tenant {tenant_name!r} already has {count} adapters (limit {max_count})")
            else:
                existing = session.scalar(select(AdapterVersion).where(
                    AdapterVersion.adapter_id == adapter.id, AdapterVersion.sha256 == digest))
                if existing is not None:  # re-read in a transaction that may write
                    existing_id = existing.id
                    session.rollback()
                    return _reupload(session=session, store=store, settings=settings,
                                     version=session.get(AdapterVersion, existing_id), base=base)
            _put_blob(session, store, config_sha, staged.config_path)
            _put_blob(session, store, weights_sha, staged.weights_path)
            session.rollback()  # end the read transaction before the write one

            _insert_blob(session, config_sha, config_size)
            _insert_blob(session, weights_sha, weights_size)
            adapter = _adapter_or_none(session, tenant, name, lock=True)
            created = adapter is None
            if created:
                adapter = Adapter(tenant_id=tenant.id, name=name, next_version=1)
                session.add(adapter)
                session.flush()
            version = AdapterVersion(
                adapter=adapter, version=adapter.next_version, sha256=digest,
                config_sha256=config_sha, weights_sha256=weights_sha,
                object_key=blob_key(weights_sha), config_object_key=blob_key(config_sha),
                size_bytes=weights_size, status="validating", base_model=base.name if base else None,
                base_description=base.to_dict() if base else None, validation_started_at=utcnow(),
            )
            adapter.next_version += 1
            session.add(version)
            session.commit()
        except IntegrityError:
            session.rollback()
            raise Conflict(f"adapter {name!r} was changed by a concurrent upload; try again") from None
        except SQLAlchemyError as e:
            session.rollback()
            raise _db_unavailable(e) from e
        except ObjectStoreError:
            session.rollback()
            raise
    return _start_validation(session=session, store=store, settings=settings, version=version,
                             discard_on_failure=created)


def _stuck_cutoff(settings: RegistrySettings) -> datetime:
    """Versions 'validating' since before this were left by a process that died."""
    return utcnow() - timedelta(seconds=settings.validation_timeout_s + STUCK_SLACK_S)


def _is_stuck(version: AdapterVersion, settings: RegistrySettings) -> bool:
    started = version.validation_started_at or version.created_at
    if started is not None and started.tzinfo is None:  # SQLite hands back naive UTC
        started = started.replace(tzinfo=timezone.utc)
    return version.status == "validating" and (started is None or started < _stuck_cutoff(settings))


def _reupload(*, session: Session, store: ObjectStore, settings: RegistrySettings, version: AdapterVersion,
              base: BaseModelShape | None) -> AdapterVersion:
    if version.status == "quarantined":  # the engine's verdict stands; the upload only restores it
        if version.deleted_at is not None:
            version.deleted_at = None
            session.commit()
        return version
    if version.deleted_at is None and version.status != "rejected" and not _is_stuck(version, settings):
        return version
    version.deleted_at = None
    version.status = "validating"
    version.rejection_reason = None
    version.base_model = base.name if base else None
    version.base_description = base.to_dict() if base else None
    version.validation_started_at = utcnow()
    session.commit()
    return _start_validation(session=session, store=store, settings=settings, version=version,
                             discard_on_failure=False, keep_on_failure=True)


def _start_validation(*, session: Session, store: ObjectStore, settings: RegistrySettings, version: AdapterVersion,
                      discard_on_failure: bool, keep_on_failure: bool = False) -> AdapterVersion:
    """Validate `version` inline (embedded) or queue it. If that cannot start, a new version is
    removed again (with its adapter when `discard_on_failure`), an existing one (re-upload,
    recovery: `keep_on_failure`) stays 'validating' for recover_stuck_versions; either way the
    caller gets RegistryUnavailable."""
    try:
        if settings.celery_eager:
            return validate_version(session=session, store=store, settings=settings, version_id=version.id)
        send_validation(settings=settings, version_id=version.id)
        return version
    except Unavailable:  # the registry's or the object store's
        _forget(session, version, keep=keep_on_failure, drop_adapter=discard_on_failure)
        raise
    except Exception as e:  # the broker refused the task (kombu raises many types)
        _forget(session, version, keep=keep_on_failure, drop_adapter=discard_on_failure)
        log.warning("validation task for adapter version id %s not queued: %s", version.id, e)
        outcome = "it will be validated later" if keep_on_failure else "nothing was stored"
        raise RegistryUnavailable(f"validation queue unavailable ({type(e).__name__}); {outcome}") from e


def _forget(session: Session, version: AdapterVersion, *, keep: bool, drop_adapter: bool) -> None:
    if keep:
        session.rollback()
    else:
        _discard(session, version, drop_adapter=drop_adapter)


def _discard(session: Session, version: AdapterVersion, *, drop_adapter: bool) -> None:
    """Remove a version that never became visible as validated (its blobs are left to GC)."""
    try:
        session.rollback()
        adapter = version.adapter
        session.delete(version)
        session.flush()
        if drop_adapter:
            remaining = session.scalar(select(func.count(AdapterVersion.id)).where(AdapterVersion.adapter_id == adapter.id))
            if remaining == 0:
                session.delete(adapter)
        session.commit()
    except SQLAlchemyError:
        session.rollback()  # the database is gone too; cleanup.collect_garbage handles stale rows


def _base_of(version: AdapterVersion, settings: RegistrySettings) -> BaseModelShape | None:
    """The base model description `version` is validated against: the one recorded at upload;
    for a version uploaded before descriptions were recorded, the served model its base_model
    names, if served now (else None: validation rejects it, asking for the upload again)."""
    if version.base_description is not None:
        try:
            return BaseModelShape.from_dict(version.base_description)
        except ValueError:
            log.warning("adapter version id %s has a malformed base description", version.id)
            return None
    if version.base_model and settings.served_base_models:
        matches = match_base_model(version.base_model, settings.served_names, settings.aliases)
        if len(matches) == 1:
            return settings.served_model(matches[0])
    return None


def validate_version(*, session: Session, store: ObjectStore, settings: RegistrySettings, version_id: int) -> AdapterVersion:
    """Validate a 'validating' version from its stored files, against the base model description
    recorded with it, and commit 'ready' (with the parsed
    rank, alpha, modules, base, dtype; current pointer moved when it is the newest ready) or
    'rejected' (with the reason: a rule, or the validation child's deadline, memory limit or
    crash). Versions already decided are returned unchanged, so a retried task is harmless.
    Raises RegistryUnavailable if the store or database fails, or no child process can be
    started (retry later)."""
    version = session.get(AdapterVersion, version_id)
    if version is None:
        raise NotFound(f"adapter version id {version_id} not found")
    if version.status != "validating":
        return version
    session.rollback()  # no transaction stays open while the files download and validate
    with tempfile.TemporaryDirectory(prefix="tessera-validate-") as work:
        config_path, weights_path = Path(work) / "config.json", Path(work) / "weights.safetensors"
        store.get_file(version.config_object_key, config_path)
        store.get_file(version.object_key, weights_path)
        if sha256_file(config_path)[0] != version.config_sha256 or sha256_file(weights_path)[0] != version.weights_sha256:
            raise RegistryUnavailable(f"stored files of {version.ref} do not match their sha256; object store corrupt")
        try:
            result = validate_in_sandbox(config_path=config_path, weights_path=weights_path,
                                         settings=settings, base=_base_of(version, settings))
        except OSError as e:  # no child process could be started: the host's fault, not the adapter's
            session.rollback()
            raise RegistryUnavailable(f"validation could not start ({type(e).__name__}); try again") from e
        except AdapterRejected as e:
            version.status = "rejected"
            version.rejection_reason = str(e)
        else:
            c = result.config
            version.status = "ready"
            version.base_model, version.base_description = result.base.name, result.base.to_dict()
            # rank: the largest module rank (rank_pattern may raise some modules above r).
            version.rank, version.alpha, version.use_rslora = (c.largest_rank(result.base.num_layers)[0],
                                                               c.alpha, c.use_rslora)
            version.target_modules = list(c.target_modules)
            version.dtype = result.dtype
    version.validated_at = utcnow()
    with _database_call(session):
        if version.status == "ready":
            adapter = version.adapter
            current = session.get(AdapterVersion, adapter.current_version_id) if adapter.current_version_id else None
            if current is None or current.version < version.version:
                adapter.current_version_id = version.id
        session.commit()
    metrics.validated(version)
    return version


# ---------------------------------------------------------------- current pointer, deletion


def set_current_version(*, session: Session, tenant: Tenant, ref: str) -> AdapterVersion:
    """Point the adapter's current version at `ref` (name@N); it must be ready (else Conflict)."""
    version = resolve_version(session=session, tenant=tenant, ref=ref, require_ready=True)
    version.adapter.current_version_id = version.id
    session.commit()
    return version


def delete_adapter(*, session: Session, tenant: Tenant, ref: str) -> None:
    """Soft-delete the tenant's adapter `name` with all its versions, or one version `name@N`.
    Deleting the current version moves the pointer to the newest remaining ready version."""
    name, version = parse_ref(ref)
    adapter = get_adapter(session=session, tenant=tenant, name=name)
    now = utcnow()
    if version is None:
        for v in list_versions(session=session, tenant=tenant, name=name):
            v.deleted_at = now
        adapter.deleted_at = now
        adapter.current_version_id = None
    else:
        v = resolve_version(session=session, tenant=tenant, ref=ref, require_ready=False)
        v.deleted_at = now
        if adapter.current_version_id == v.id:
            session.flush()
            adapter.current_version_id = _newest_ready_id(session, adapter.id)
    session.commit()


def _newest_ready_id(session: Session, adapter_id: int) -> int | None:
    return session.scalar(
        select(AdapterVersion.id)
        .where(AdapterVersion.adapter_id == adapter_id, AdapterVersion.status == "ready",
               AdapterVersion.deleted_at.is_(None))
        .order_by(AdapterVersion.version.desc()).limit(1))


# ---------------------------------------------------------------- stuck versions, quarantine


def recover_stuck_versions(*, session: Session, store: ObjectStore, settings: RegistrySettings) -> int:
    """Validate again every version left 'validating' for longer than the validation deadline
    (plus STUCK_SLACK_S) by a process that died: inline in embedded mode (each ends ready or
    rejected), else re-queued for a worker. Returns how many were recovered; a version whose
    validation cannot start now (store, database or broker down) stays for the next call."""
    ids = list(session.scalars(
        select(AdapterVersion.id)
        .where(AdapterVersion.status == "validating", AdapterVersion.deleted_at.is_(None),
               func.coalesce(AdapterVersion.validation_started_at, AdapterVersion.created_at) < _stuck_cutoff(settings))
        .order_by(AdapterVersion.id)))
    session.rollback()
    recovered = 0
    for version_id in ids:
        version = session.get(AdapterVersion, version_id)
        if version is None or version.status != "validating":
            continue  # decided meanwhile by another process
        version.validation_started_at = utcnow()
        session.commit()
        try:
            _start_validation(session=session, store=store, settings=settings, version=version,
                              discard_on_failure=False, keep_on_failure=True)
        except Unavailable as e:
            log.warning("adapter version %s stays validating: %s", version.ref, e)
            continue
        recovered += 1
        log.info("adapter version %s was left validating; validation restarted", version.ref)
    return recovered


def reject_validation(*, session: Session, version_id: int, reason: str) -> AdapterVersion:
    """Reject version `version_id` with `reason` if it is still 'validating' (a validation that
    ran out of time outside its child process); a decided version is returned unchanged."""
    session.rollback()
    version = session.get(AdapterVersion, version_id)
    if version is None:
        raise NotFound(f"adapter version id {version_id} not found")
    if version.status == "validating":
        version.status, version.rejection_reason, version.validated_at = "rejected", reason, utcnow()
        with _database_call(session):
            session.commit()
        metrics.validated(version)
    return version


def recover_stuck_versions_at_start(ctx) -> int:
    """recover_stuck_versions in its own session of `ctx` (a Context), for a gateway's or
    worker's start: logs and returns 0 on any failure, never raises."""
    try:
        with ctx.session_factory() as session:
            return recover_stuck_versions(session=session, store=ctx.store, settings=ctx.settings)
    except Exception:
        log.exception("recovering adapter versions left validating failed")
        return 0


def quarantine_version(*, session: Session, sha256: str, reason: str) -> int:
    """Mark every ready version with digest `sha256` (any tenant's; the same bytes fail alike)
    'quarantined' with `reason` in rejection_reason, so it is never resolved or fetched again,
    and move each affected adapter's current pointer to its newest remaining ready version (or
    none). Returns how many versions were quarantined (0: none ready, e.g. already quarantined).
    Raises RegistryUnavailable if the database fails."""
    with _database_call(session):
        versions = list(session.scalars(select(AdapterVersion).where(
            AdapterVersion.sha256 == sha256, AdapterVersion.status == "ready")))
        for v in versions:
            v.status = "quarantined"
            v.rejection_reason = reason
        session.flush()
        for v in versions:
            if v.adapter.current_version_id == v.id:
                v.adapter.current_version_id = _newest_ready_id(session, v.adapter_id)
        session.commit()
    if versions:
        metrics.quarantined(len(versions))
    return len(versions)
