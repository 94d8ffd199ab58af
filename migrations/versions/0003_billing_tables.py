"""Reserved, empty: databases were migrated past it before the billing work landed, so the
billing tables are created by 0005 instead (filling this one in would skip them there).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
