"""ORM models: tenants, adapters (a name within a tenant) and immutable adapter versions.

An adapter version's bytes never change: it is named by `sha256` (see content.version_digest)
and points at content-addressed blobs in the object store. `adapters.current_version_id` is the
version `name` (without `@N`) resolves to. Rows are soft-deleted (`deleted_at`), so usage and
billing records that name a version keep a target.
"""
from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column, relationship

from tessera_core.db import Base, utcnow

TENANT_STATUSES = ("active", "suspended")
# quarantined: was ready, then the engine found it faulty (non-finite outputs); never served again.
VERSION_STATUSES = ("validating", "ready", "rejected", "quarantined")


class Tenant(Base):
    """A customer. Limits left NULL fall back to the registry settings (the platform's plans can
    set them later)."""

    __tablename__ = "tenants"
    __table_args__ = (
        CheckConstraint("status IN ('active', 'suspended')", name="status"),
        # Names are unique among live tenants; a deleted tenant's name can be reused.
        Index("uq_tenants_name_live", "name", unique=True, sqlite_where=text("deleted_at IS NULL"),
              postgresql_where=text("deleted_at IS NULL")),
        # ... and ignoring case (adapter_registry.names; migration 0012 adds it where no live
        # names collide, and reports those that do).
        Index("uq_tenants_lower_name_live", func.lower(text("name")), unique=True,
              sqlite_where=text("deleted_at IS NULL"), postgresql_where=text("deleted_at IS NULL")),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), default="active")
    max_adapters: Mapped[int | None] = mapped_column(Integer)
    max_adapter_bytes: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, onupdate=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Blob(Base):
    """One stored object, by the sha256 of its bytes: the same bytes are stored once, whoever
    uploads them. A blob no live version references is removed by gc.collect_garbage."""

    __tablename__ = "blobs"

    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    object_key: Mapped[str] = mapped_column(String(512))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Adapter(Base):
    """A tenant's named adapter: a sequence of immutable versions and a current pointer."""

    __tablename__ = "adapters"
    __table_args__ = (
        Index("uq_adapters_tenant_id_name_live", "tenant_id", "name", unique=True,
              sqlite_where=text("deleted_at IS NULL"), postgresql_where=text("deleted_at IS NULL")),
        Index("uq_adapters_tenant_id_lower_name_live", "tenant_id", func.lower(text("name")), unique=True,
              sqlite_where=text("deleted_at IS NULL"), postgresql_where=text("deleted_at IS NULL")),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id"), index=True)
    name: Mapped[str] = mapped_column(String(64))
    current_version_id: Mapped[int | None] = mapped_column(
        # use_alter: adapters and adapter_versions reference each other.
        ForeignKey("adapter_versions.id", use_alter=True, ondelete="SET NULL")
    )
    next_version: Mapped[int] = mapped_column(Integer, default=1)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, onupdate=utcnow)
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    tenant: Mapped[Tenant] = relationship()
    current_version: Mapped["AdapterVersion | None"] = relationship(foreign_keys=[current_version_id], post_update=True)


class AdapterVersion(Base):
    """An immutable adapter version. Fields parsed from the files (rank, alpha, ...) are set by
    validation; until then status is 'validating' (since validation_started_at). A rejected or
    quarantined version keeps its reason in rejection_reason."""

    __tablename__ = "adapter_versions"
    __table_args__ = (
        UniqueConstraint("adapter_id", "version"),
        UniqueConstraint("adapter_id", "sha256"),
        CheckConstraint("status IN ('validating', 'ready', 'rejected', 'quarantined')", name="status"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    adapter_id: Mapped[int] = mapped_column(ForeignKey("adapters.id"), index=True)
    version: Mapped[int] = mapped_column(Integer)
    sha256: Mapped[str] = mapped_column(String(64), index=True)
    config_sha256: Mapped[str] = mapped_column(ForeignKey("blobs.sha256"))
    weights_sha256: Mapped[str] = mapped_column(ForeignKey("blobs.sha256"))
    object_key: Mapped[str] = mapped_column(String(512))
    config_object_key: Mapped[str] = mapped_column(String(512))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(String(16), default="validating")
    rejection_reason: Mapped[str | None] = mapped_column(Text)
    base_model: Mapped[str | None] = mapped_column(String(256))
    # The served base model's description (peft_format.BaseModelShape.to_dict) the upload was
    # accepted for: what validation checks the files against, wherever and whenever it runs.
    base_description: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    rank: Mapped[int | None] = mapped_column(Integer)
    alpha: Mapped[float | None] = mapped_column(Float)
    use_rslora: Mapped[bool | None] = mapped_column(Boolean)
    target_modules: Mapped[list[Any] | None] = mapped_column(JSON)
    dtype: Mapped[str | None] = mapped_column(String(8))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    validated_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # When the current 'validating' spell began (upload, re-upload, re-queue); a version validating
    # for longer than the deadline was left by a dead process (services.recover_stuck_versions).
    validation_started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    adapter: Mapped[Adapter] = relationship(foreign_keys=[adapter_id])

    @property
    def ref(self) -> str:
        """The `name@version` a tenant uses to pin this version."""
        return f"{self.adapter.name}@{self.version}"
