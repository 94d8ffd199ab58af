"""Adapter versions: status 'quarantined' (a ready version the engine found faulty, its reason in
rejection_reason) and validation_started_at (when the current 'validating' spell began, so a
version left validating by a dead process can be told from one being validated now).

Batch mode: SQLite cannot alter a CHECK constraint in place (the table is copied, and the
adapters' current pointers, which the copy's DROP would null, are put back).

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None

_STATUSES = "status IN ('validating', 'ready', 'rejected', 'quarantined')"
_OLD_STATUSES = "status IN ('validating', 'ready', 'rejected')"


def _current_pointers() -> list:
    """adapters.current_version_id where set, on SQLite: rebuilding adapter_versions drops the old
    table, and SQLite's foreign keys then null every pointer (ON DELETE SET NULL)."""
    bind = op.get_bind()
    if bind.dialect.name != "sqlite":
        return []
    return bind.execute(sa.text("SELECT id, current_version_id FROM adapters WHERE current_version_id IS NOT NULL")).all()


def _restore_pointers(pointers: list) -> None:
    for adapter_id, version_id in pointers:
        op.get_bind().execute(sa.text("UPDATE adapters SET current_version_id = :v WHERE id = :a"),
                              {"v": version_id, "a": adapter_id})


def upgrade() -> None:
    pointers = _current_pointers()
    with op.batch_alter_table('adapter_versions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('validation_started_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.drop_constraint(batch_op.f('ck_adapter_versions_status'), type_='check')
        batch_op.create_check_constraint(batch_op.f('ck_adapter_versions_status'), sa.text(_STATUSES))
    _restore_pointers(pointers)


def downgrade() -> None:
    # A quarantined version must never be served again: it goes down as rejected, with its reason.
    op.execute("UPDATE adapter_versions SET status = 'rejected' WHERE status = 'quarantined'")
    pointers = _current_pointers()
    with op.batch_alter_table('adapter_versions', schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f('ck_adapter_versions_status'), type_='check')
        batch_op.create_check_constraint(batch_op.f('ck_adapter_versions_status'), sa.text(_OLD_STATUSES))
        batch_op.drop_column('validation_started_at')
    _restore_pointers(pointers)
