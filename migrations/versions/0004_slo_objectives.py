"""SLO objectives per plan (defaults of its tenants) with per-tenant overrides: slo_objectives.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('slo_objectives',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('plan_id', sa.Integer(), nullable=True),
    sa.Column('tenant_id', sa.Integer(), nullable=True),
    sa.Column('availability_target', sa.Float(), nullable=True),
    sa.Column('ttft_threshold_ms', sa.Integer(), nullable=True),
    sa.Column('ttft_target', sa.Float(), nullable=True),
    sa.Column('tpot_threshold_ms', sa.Integer(), nullable=True),
    sa.Column('tpot_target', sa.Float(), nullable=True),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.CheckConstraint('(plan_id IS NULL) <> (tenant_id IS NULL)', name=op.f('ck_slo_objectives_one_owner')),
    sa.ForeignKeyConstraint(['plan_id'], ['plans.id'], name=op.f('fk_slo_objectives_plan_id_plans'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_slo_objectives_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_slo_objectives')),
    sa.UniqueConstraint('plan_id', name=op.f('uq_slo_objectives_plan_id')),
    sa.UniqueConstraint('tenant_id', name=op.f('uq_slo_objectives_tenant_id'))
    )


def downgrade() -> None:
    op.drop_table('slo_objectives')
