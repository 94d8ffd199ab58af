"""The end user and safety identifier a request named (OpenAI's `user` and `safety_identifier`),
on its usage event, for the tenant's own usage reports (group_by end_user).

Nullable columns without a default: adding them rewrites no table on Postgres or SQLite, and
earlier events have none.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-26
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('usage_events', schema=None) as batch_op:
        batch_op.add_column(sa.Column('end_user', sa.String(length=256), nullable=True))
        batch_op.add_column(sa.Column('safety_identifier', sa.String(length=256), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('usage_events', schema=None) as batch_op:
        batch_op.drop_column('safety_identifier')
        batch_op.drop_column('end_user')
