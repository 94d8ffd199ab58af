"""Reserved and empty on purpose; do not fill it in, renumber it or remove it.

Revision 0003 was once meant for the billing tables, and databases were upgraded past an empty
0003 before that work landed; they record 0003 as applied and would never run anything added
here. So the billing tables are created by 0005 (0005_billing_tables.py), and this revision
stays a no-op link in the chain 0002 -> 0003 -> 0004: removing it or changing its id would
break `alembic upgrade` on every database that records it. (Alembic records revision ids,
never file names, so the file's name is free.)

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
    """Nothing: see the module docstring."""


def downgrade() -> None:
    """Nothing: see the module docstring."""
