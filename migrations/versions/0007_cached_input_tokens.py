"""Cached prompt tokens: usage_events.cached_tokens (of prompt_tokens, those the engine's prefix
cache served); the billing token kind 'cached_input' (billing_prices.token_kind widened to hold
it); billing_line_items.cached_input_tokens and cached_input_price; billing_invoices.cached_input_tokens.

Existing rows get 0 cached tokens, and pending line items the price their cached tokens would be
billed at without a cached_input price (their input price), so their amounts stay exactly as they
were. Adding a column with a constant default rewrites no table on Postgres (11+) and none on
SQLite (a literal default: batch mode copies a table for an expression); only billing_prices
(small, referenced by no foreign key) is copied on SQLite, to change its CHECK constraint.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-24
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None

_KINDS = "token_kind IN ('input', 'cached_input', 'output')"
_OLD_KINDS = "token_kind IN ('input', 'output')"


def upgrade() -> None:
    with op.batch_alter_table('usage_events', schema=None) as batch_op:
        batch_op.add_column(sa.Column('cached_tokens', sa.Integer(), server_default='0', nullable=False))

    with op.batch_alter_table('billing_line_items', schema=None) as batch_op:
        batch_op.add_column(sa.Column('cached_input_tokens', sa.BigInteger(), server_default='0',
                                      nullable=False))
        batch_op.add_column(sa.Column('cached_input_price', sa.BigInteger(), nullable=True))
    op.execute("UPDATE billing_line_items SET cached_input_price = input_price")

    with op.batch_alter_table('billing_invoices', schema=None) as batch_op:
        batch_op.add_column(sa.Column('cached_input_tokens', sa.BigInteger(), server_default='0',
                                      nullable=False))

    with op.batch_alter_table('billing_prices', schema=None) as batch_op:
        batch_op.alter_column('token_kind', existing_type=sa.String(length=8), type_=sa.String(length=16),
                              existing_nullable=False)
        batch_op.drop_constraint(batch_op.f('ck_billing_prices_token_kind'), type_='check')
        batch_op.create_check_constraint(batch_op.f('ck_billing_prices_token_kind'), sa.text(_KINDS))


def downgrade() -> None:
    # The old schema has no cached_input kind: its prices go, and the old rollup re-prices pending
    # items with every prompt token at the input price; invoiced items keep what they were billed.
    op.execute("DELETE FROM billing_prices WHERE token_kind = 'cached_input'")
    with op.batch_alter_table('billing_prices', schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f('ck_billing_prices_token_kind'), type_='check')
        batch_op.create_check_constraint(batch_op.f('ck_billing_prices_token_kind'), sa.text(_OLD_KINDS))
        batch_op.alter_column('token_kind', existing_type=sa.String(length=16), type_=sa.String(length=8),
                              existing_nullable=False)

    # ALTER TABLE ... DROP COLUMN (SQLite >= 3.35 too), not batch mode: rebuilding billing_invoices
    # on SQLite would drop a table the line items' foreign key points at.
    op.drop_column('billing_invoices', 'cached_input_tokens')
    op.drop_column('billing_line_items', 'cached_input_price')
    op.drop_column('billing_line_items', 'cached_input_tokens')
    op.drop_column('usage_events', 'cached_tokens')
