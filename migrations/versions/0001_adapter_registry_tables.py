"""Adapter registry tables: tenants, blobs, adapters, adapter_versions.

Revision ID: 0001
Revises: 
Create Date: 2026-11-22

adapters.current_version_id and adapter_versions.adapter_id reference each other, so the
current-version foreign key is added after both tables exist (and dropped first on downgrade).
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('blobs',
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('object_key', sa.String(length=512), nullable=False),
    sa.Column('size_bytes', sa.BigInteger(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('sha256', name=op.f('pk_blobs'))
    )
    op.create_table('tenants',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('max_adapters', sa.Integer(), nullable=True),
    sa.Column('max_adapter_bytes', sa.BigInteger(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('deleted_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("status IN ('active', 'suspended')", name=op.f('ck_tenants_status')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_tenants'))
    )
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.create_index('uq_tenants_name_live', ['name'], unique=True, sqlite_where=sa.text('deleted_at IS NULL'), postgresql_where=sa.text('deleted_at IS NULL'))

    op.create_table('adapters',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('tenant_id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('current_version_id', sa.Integer(), nullable=True),
    sa.Column('next_version', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('deleted_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_adapters_tenant_id_tenants')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_adapters'))
    )
    with op.batch_alter_table('adapters', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_adapters_tenant_id'), ['tenant_id'], unique=False)
        batch_op.create_index('uq_adapters_tenant_id_name_live', ['tenant_id', 'name'], unique=True, sqlite_where=sa.text('deleted_at IS NULL'), postgresql_where=sa.text('deleted_at IS NULL'))

    op.create_table('adapter_versions',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('adapter_id', sa.Integer(), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('config_sha256', sa.String(length=64), nullable=False),
    sa.Column('weights_sha256', sa.String(length=64), nullable=False),
    sa.Column('object_key', sa.String(length=512), nullable=False),
    sa.Column('config_object_key', sa.String(length=512), nullable=False),
    sa.Column('size_bytes', sa.BigInteger(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('rejection_reason', sa.Text(), nullable=True),
    sa.Column('base_model', sa.String(length=256), nullable=True),
    sa.Column('rank', sa.Integer(), nullable=True),
    sa.Column('alpha', sa.Float(), nullable=True),
    sa.Column('use_rslora', sa.Boolean(), nullable=True),
    sa.Column('target_modules', sa.JSON(), nullable=True),
    sa.Column('dtype', sa.String(length=8), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('validated_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('deleted_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("status IN ('validating', 'ready', 'rejected')", name=op.f('ck_adapter_versions_status')),
    sa.ForeignKeyConstraint(['adapter_id'], ['adapters.id'], name=op.f('fk_adapter_versions_adapter_id_adapters')),
    sa.ForeignKeyConstraint(['config_sha256'], ['blobs.sha256'], name=op.f('fk_adapter_versions_config_sha256_blobs')),
    sa.ForeignKeyConstraint(['weights_sha256'], ['blobs.sha256'], name=op.f('fk_adapter_versions_weights_sha256_blobs')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_adapter_versions')),
    sa.UniqueConstraint('adapter_id', 'sha256', name=op.f('uq_adapter_versions_adapter_id_sha256')),
    sa.UniqueConstraint('adapter_id', 'version', name=op.f('uq_adapter_versions_adapter_id_version'))
    )
    with op.batch_alter_table('adapter_versions', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_adapter_versions_adapter_id'), ['adapter_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_adapter_versions_sha256'), ['sha256'], unique=False)
    with op.batch_alter_table('adapters', schema=None) as batch_op:
        batch_op.create_foreign_key(batch_op.f('fk_adapters_current_version_id_adapter_versions'),
                                    'adapter_versions', ['current_version_id'], ['id'], ondelete='SET NULL')


def downgrade() -> None:
    with op.batch_alter_table('adapters', schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f('fk_adapters_current_version_id_adapter_versions'), type_='foreignkey')
    with op.batch_alter_table('adapter_versions', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_adapter_versions_sha256'))
        batch_op.drop_index(batch_op.f('ix_adapter_versions_adapter_id'))

    op.drop_table('adapter_versions')
    with op.batch_alter_table('adapters', schema=None) as batch_op:
        batch_op.drop_index('uq_adapters_tenant_id_name_live', sqlite_where=sa.text('deleted_at IS NULL'), postgresql_where=sa.text('deleted_at IS NULL'))
        batch_op.drop_index(batch_op.f('ix_adapters_tenant_id'))

    op.drop_table('adapters')
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.drop_index('uq_tenants_name_live', sqlite_where=sa.text('deleted_at IS NULL'), postgresql_where=sa.text('deleted_at IS NULL'))

    op.drop_table('tenants')
    op.drop_table('blobs')
