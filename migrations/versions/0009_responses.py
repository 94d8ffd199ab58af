"""Stored responses of the Responses API (POST /v1/responses with store true): one row per
response id, owned by a tenant (deleted with it), its input and output items as JSON so
previous_response_id can rebuild a conversation; retention deletes by age
(tessera.responses_store).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('responses',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('tenant_id', sa.Integer(), nullable=False),
    sa.Column('api_key_id', sa.Integer(), nullable=True),
    sa.Column('model', sa.String(length=200), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('previous_response_id', sa.String(length=64), nullable=True),
    sa.Column('instructions', sa.String(), nullable=True),
    sa.Column('input_items', sa.JSON(), nullable=False),
    sa.Column('output_items', sa.JSON(), nullable=False),
    sa.Column('usage', sa.JSON(), nullable=True),
    sa.Column('metadata', sa.JSON(), nullable=False),
    sa.Column('params', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['api_key_id'], ['api_keys.id'], name=op.f('fk_responses_api_key_id_api_keys'),
                            ondelete='SET NULL'),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_responses_tenant_id_tenants'),
                            ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_responses'))
    )
    with op.batch_alter_table('responses', schema=None) as batch_op:
        batch_op.create_index('ix_responses_tenant_id_created_at', ['tenant_id', 'created_at'], unique=False)
        batch_op.create_index('ix_responses_created_at', ['created_at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('responses', schema=None) as batch_op:
        batch_op.drop_index('ix_responses_created_at')
        batch_op.drop_index('ix_responses_tenant_id_created_at')

    op.drop_table('responses')
