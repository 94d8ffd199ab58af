"""Billing tables: billing_prices (the price book and tenant contract prices), billing_runs,
billing_line_items, billing_invoices, billing_exports; plans.monthly_included_tokens;
usage_events.base_model and usage_events.billing_run_id (with a partial index on the events no
rollup has taken yet).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-22
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('billing_runs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('cutoff', sa.DateTime(timezone=True), nullable=False),
    sa.Column('events', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_billing_runs'))
    )
    op.create_table('billing_exports',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('tenant_id', sa.Integer(), nullable=False),
    sa.Column('period_start', sa.Date(), nullable=False),
    sa.Column('format', sa.String(length=8), nullable=False),
    sa.Column('object_key', sa.String(length=500), nullable=False),
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('size_bytes', sa.BigInteger(), nullable=False),
    sa.Column('rows', sa.Integer(), nullable=False),
    sa.Column('final', sa.Boolean(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.CheckConstraint("format IN ('csv', 'parquet', 'jsonl')", name=op.f('ck_billing_exports_format')),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_billing_exports_tenant_id_tenants')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_billing_exports')),
    sa.UniqueConstraint('tenant_id', 'period_start', 'format', name=op.f('uq_billing_exports_tenant_id_period_start_format'))
    )
    with op.batch_alter_table('billing_exports', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_billing_exports_tenant_id'), ['tenant_id'], unique=False)

    op.create_table('billing_invoices',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('tenant_id', sa.Integer(), nullable=False),
    sa.Column('period_start', sa.Date(), nullable=False),
    sa.Column('period_end', sa.Date(), nullable=False),
    sa.Column('currency', sa.String(length=3), nullable=False),
    sa.Column('line_items', sa.Integer(), nullable=False),
    sa.Column('requests', sa.BigInteger(), nullable=False),
    sa.Column('input_tokens', sa.BigInteger(), nullable=False),
    sa.Column('output_tokens', sa.BigInteger(), nullable=False),
    sa.Column('subtotal_micros', sa.BigInteger(), nullable=False),
    sa.Column('allowance_tokens', sa.BigInteger(), nullable=False),
    sa.Column('allowance_used_tokens', sa.BigInteger(), nullable=False),
    sa.Column('allowance_credit_micros', sa.BigInteger(), nullable=False),
    sa.Column('total_micros', sa.BigInteger(), nullable=False),
    sa.Column('held', sa.JSON(), nullable=False),
    sa.Column('closed_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_billing_invoices_tenant_id_tenants')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_billing_invoices')),
    sa.UniqueConstraint('tenant_id', 'period_start', name=op.f('uq_billing_invoices_tenant_id_period_start'))
    )
    with op.batch_alter_table('billing_invoices', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_billing_invoices_tenant_id'), ['tenant_id'], unique=False)

    op.create_table('billing_prices',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('tenant_id', sa.Integer(), nullable=True),
    sa.Column('base_model', sa.String(length=200), nullable=False),
    sa.Column('priority', sa.String(length=16), nullable=False),
    sa.Column('token_kind', sa.String(length=8), nullable=False),
    sa.Column('micros_per_mtok', sa.BigInteger(), nullable=False),
    sa.Column('effective_from', sa.Date(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.CheckConstraint("token_kind IN ('input', 'output')", name=op.f('ck_billing_prices_token_kind')),
    sa.CheckConstraint('micros_per_mtok >= 0', name=op.f('ck_billing_prices_non_negative')),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_billing_prices_tenant_id_tenants')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_billing_prices'))
    )
    with op.batch_alter_table('billing_prices', schema=None) as batch_op:
        batch_op.create_index('uq_billing_prices_book', ['base_model', 'priority', 'token_kind', 'effective_from'], unique=True, sqlite_where=sa.text('tenant_id IS NULL'), postgresql_where=sa.text('tenant_id IS NULL'))
        batch_op.create_index('uq_billing_prices_tenant', ['tenant_id', 'base_model', 'priority', 'token_kind', 'effective_from'], unique=True, sqlite_where=sa.text('tenant_id IS NOT NULL'), postgresql_where=sa.text('tenant_id IS NOT NULL'))

    op.create_table('billing_line_items',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('tenant_id', sa.Integer(), nullable=False),
    sa.Column('usage_day', sa.Date(), nullable=False),
    sa.Column('base_model', sa.String(length=200), nullable=False),
    sa.Column('adapter', sa.String(length=200), nullable=False),
    sa.Column('priority', sa.String(length=16), nullable=False),
    sa.Column('requests', sa.BigInteger(), nullable=False),
    sa.Column('input_tokens', sa.BigInteger(), nullable=False),
    sa.Column('output_tokens', sa.BigInteger(), nullable=False),
    sa.Column('input_price', sa.BigInteger(), nullable=True),
    sa.Column('output_price', sa.BigInteger(), nullable=True),
    sa.Column('amount_picos', sa.BigInteger(), nullable=True),
    sa.Column('invoice_id', sa.Integer(), nullable=True),
    sa.ForeignKeyConstraint(['invoice_id'], ['billing_invoices.id'], name=op.f('fk_billing_line_items_invoice_id_billing_invoices')),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_billing_line_items_tenant_id_tenants')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_billing_line_items'))
    )
    with op.batch_alter_table('billing_line_items', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_billing_line_items_invoice_id'), ['invoice_id'], unique=False)
        batch_op.create_index('uq_billing_line_items_pending', ['tenant_id', 'usage_day', 'base_model', 'adapter', 'priority'], unique=True, sqlite_where=sa.text('invoice_id IS NULL'), postgresql_where=sa.text('invoice_id IS NULL'))

    with op.batch_alter_table('plans', schema=None) as batch_op:
        batch_op.add_column(sa.Column('monthly_included_tokens', sa.BigInteger(), nullable=True))

    with op.batch_alter_table('usage_events', schema=None) as batch_op:
        batch_op.add_column(sa.Column('base_model', sa.String(length=200), nullable=True))
        batch_op.add_column(sa.Column('billing_run_id', sa.BigInteger(), nullable=True))
        batch_op.create_index('ix_usage_events_unbilled', ['created_at'], unique=False, sqlite_where=sa.text('billing_run_id IS NULL'), postgresql_where=sa.text('billing_run_id IS NULL'))
        batch_op.drop_index('ix_usage_events_tenant_id')
        batch_op.drop_index('ix_usage_events_created_at')
        batch_op.create_index('ix_usage_events_tenant_id_created_at', ['tenant_id', 'created_at'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('usage_events', schema=None) as batch_op:
        batch_op.drop_index('ix_usage_events_unbilled', sqlite_where=sa.text('billing_run_id IS NULL'), postgresql_where=sa.text('billing_run_id IS NULL'))
        batch_op.drop_index('ix_usage_events_tenant_id_created_at')
        batch_op.create_index('ix_usage_events_created_at', ['created_at'], unique=False)
        batch_op.create_index('ix_usage_events_tenant_id', ['tenant_id'], unique=False)
        batch_op.drop_column('billing_run_id')
        batch_op.drop_column('base_model')

    with op.batch_alter_table('plans', schema=None) as batch_op:
        batch_op.drop_column('monthly_included_tokens')

    with op.batch_alter_table('billing_line_items', schema=None) as batch_op:
        batch_op.drop_index('uq_billing_line_items_pending', sqlite_where=sa.text('invoice_id IS NULL'), postgresql_where=sa.text('invoice_id IS NULL'))
        batch_op.drop_index(batch_op.f('ix_billing_line_items_invoice_id'))

    op.drop_table('billing_line_items')
    with op.batch_alter_table('billing_prices', schema=None) as batch_op:
        batch_op.drop_index('uq_billing_prices_tenant', sqlite_where=sa.text('tenant_id IS NOT NULL'), postgresql_where=sa.text('tenant_id IS NOT NULL'))
        batch_op.drop_index('uq_billing_prices_book', sqlite_where=sa.text('tenant_id IS NULL'), postgresql_where=sa.text('tenant_id IS NULL'))

    op.drop_table('billing_prices')
    with op.batch_alter_table('billing_invoices', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_billing_invoices_tenant_id'))

    op.drop_table('billing_invoices')
    with op.batch_alter_table('billing_exports', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_billing_exports_tenant_id'))

    op.drop_table('billing_exports')
    op.drop_table('billing_runs')
