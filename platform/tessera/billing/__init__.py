"""Billing: a price book, usage rolled up into priced line items, invoices per tenant and UTC
month, and exports (CSV, Parquet, CloudEvents JSONL) in the object store.

Layers (each module's docstring states its contract):
  models     tables (money as integers: prices in micro-units per 1M tokens = picos per token)
  periods    UTC calendar months
  prices     the price book and tenant contract prices; the lookup in SQL and in Python
  rollup     usage events -> pending line items, set-based, idempotent, serialized by a lock
  invoices   closing a period (late-event rule, held usage, included tokens, rounding)
  exports    files of a tenant's period, reproducible byte for byte
  jobs       the above as jobs of the platform's context
  tasks      Celery tasks + beat schedule (scale-out); embedded: the in-process timer
"""
