"""A plan's scheduling weight: its tenants' weight in the engine scheduler's fair shares of KV
blocks and prefill tokens inside a priority class (engine.scheduler). Existing plans get 1, the
weight every tenant had.

A column with a constant default rewrites no table on Postgres (11+) and none on SQLite.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-27
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


# Plain ALTER TABLE, not batch mode: SQLite (3.35+) adds and drops the column in place, where a
# batch rebuild would drop `plans`, which tenant_policies' foreign key still references.
def upgrade() -> None:
    op.add_column('plans', sa.Column('scheduling_weight', sa.Float(), server_default='1', nullable=False))


def downgrade() -> None:
    op.drop_column('plans', 'scheduling_weight')
