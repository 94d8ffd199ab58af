"""Names of tenants, adapters and API keys follow one rule (adapter_registry.names): tenant and
adapter names unique ignoring case among live rows (indexes on lower(name)), every name within
its profile.

Existing rows are not renamed: a name that breaks the rule (a trailing newline, a control
character, a tenant beside another that differs only by case...) stays as it is, and is logged
here (a WARNING per name, with its table and id) for an operator to rename. A case-insensitive
index is created only where no live names collide; where some do, they are logged and that
index is left out (the services still refuse new collisions; run this again after renaming:
downgrade one revision, then upgrade).

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-27
"""
from __future__ import annotations

import logging

from alembic import op
import sqlalchemy as sa

from adapter_registry.errors import InvalidName
from adapter_registry.names import check_identifier, check_label


revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None

log = logging.getLogger("alembic.runtime.migration")

_LIVE = sa.text("deleted_at IS NULL")
# (table, index, its columns, the columns a collision is grouped by)
_CASE_INDEXES = (
    ("tenants", "uq_tenants_lower_name_live", [sa.text("lower(name)")], "lower(name)"),
    ("adapters", "uq_adapters_tenant_id_lower_name_live", ["tenant_id", sa.text("lower(name)")],
     "tenant_id, lower(name)"),
)


def _report_names(bind) -> None:
    """Log every live tenant/adapter name and every API key name that breaks the rule."""
    checks = (("tenants", "id, name", "deleted_at IS NULL", check_identifier, "tenant name"),
              ("adapters", "id, name", "deleted_at IS NULL", check_identifier, "adapter name"),
              ("api_keys", "id, name", "name IS NOT NULL", check_label, "API key name"))
    for table, columns, where, check, what in checks:
        for row_id, name in bind.execute(sa.text(f"SELECT {columns} FROM {table} WHERE {where}")):
            try:
                check(name, what=what)
            except InvalidName as e:
                log.warning("name rule: %s id %s breaks it (not renamed): %s", table, row_id, e)


def _collisions(bind, table: str, group: str) -> list:
    return bind.execute(sa.text(
        f"SELECT {group}, count(*) FROM {table} WHERE deleted_at IS NULL GROUP BY {group} HAVING count(*) > 1")).all()


def upgrade() -> None:
    bind = op.get_bind()
    _report_names(bind)
    for table, index, columns, group in _CASE_INDEXES:
        collisions = _collisions(bind, table, group)
        if collisions:
            for row in collisions:
                log.warning("name rule: %s has live names equal ignoring case %s; %s is not created until "
                            "they are renamed", table, tuple(row[:-1]), index)
            continue
        op.create_index(index, table, columns, unique=True, sqlite_where=_LIVE, postgresql_where=_LIVE)


def downgrade() -> None:
    # IF EXISTS: upgrade may have left one out; SQLite cannot reflect an expression index to tell.
    for _, index, _, _ in _CASE_INDEXES:
        op.execute(sa.text(f"DROP INDEX IF EXISTS {index}"))
