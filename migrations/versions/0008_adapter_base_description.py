"""Adapter versions: base_description, the served base model's description (name, architecture,
layers, LoRA-able modules and their shapes: engine.lora.peft_format.BaseModelShape as JSON) an
upload was accepted for. Validation checks the files against it wherever it runs (inline, a
Celery worker that has no engine, a re-queue after a dead process), instead of a shape written in
the code.

Versions from before have none: one still validating is checked against the served model it
names, if that is served when it is validated (adapter_registry.services.validate_version).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A nullable column without a default: no table is rewritten (nor copied on SQLite).
    op.add_column('adapter_versions', sa.Column('base_description', sa.JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column('adapter_versions', 'base_description')
