"""Billing exports of one tenant's period, written to the object store.

- csv, parquet: the period's line items (the invoice's once the period is closed, else the
  pending items with usage in it), one row per (usage day, base model, adapter, priority), with
  prices in micro-units per million tokens and the exact amount (picos, and currency units as
  a 12-decimal string / decimal128(38, 12)). status is invoiced, pending or held (no price).
  input_tokens are all prompt tokens; cached_input_tokens are those of them the prefix cache
  served, billed at cached_input_price (the cached_input price, else the input price), so
  amount = (input - cached_input) x input price + cached_input x cached_input price + output x
  output price, in picos.
- jsonl: one CloudEvents 1.0 JSON object per request with usage in the period (by its time),
  `id` = uuid5 of the request id, so a meter (OpenMeter, Lago, Stripe meter events) that
  receives it twice counts it once. Its input_tokens include its cached_input_tokens, as above.

Every byte is a function of the database rows: fixed column order, rows sorted on a unique
key, JSON with sorted keys, no write timestamps (Parquet's footer names only the writer's
version). Regenerating an export from the same data gives the same file, byte for byte.
"""
from __future__ import annotations

import csv
import hashlib
import json
import tempfile
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from decimal import Decimal
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from adapter_registry.models import Tenant
from tessera.billing.invoices import period_summary
from tessera.billing.models import EXPORT_FORMATS, Export, LineItem
from tessera.billing.periods import Period
from tessera.models import UsageEvent
from tessera_core.db import utcnow
from tessera_core.objectstore import ObjectStore

#: Namespace of the CloudEvents ids (uuid5 of "tessera:usage:<request id>" under it). Never change it:
#: meters deduplicate on these ids.
EVENT_ID_NAMESPACE = uuid.UUID("6f1c2e0a-7d4b-5a39-9a47-2b8e5c1d0f31")
CLOUDEVENT_TYPE = "dev.tessera.usage.v1"
CLOUDEVENT_SOURCE = "//tessera/gateway"
LINE_ITEM_COLUMNS = ("period", "tenant", "usage_day", "base_model", "adapter", "priority", "requests",
                     "input_tokens", "cached_input_tokens", "output_tokens", "input_price_micros_per_mtok",
                     "cached_input_price_micros_per_mtok", "output_price_micros_per_mtok", "amount_picos", "amount",
                     "currency", "status", "invoice_id")
CONTENT_TYPES = {"csv": "text/csv; charset=utf-8", "parquet": "application/vnd.apache.parquet",
                 "jsonl": "application/x-ndjson"}


class ExportFormatError(ValueError):
    pass


def event_id(request_id: str) -> str:
    """The CloudEvents id of a request's usage: stable across exports and re-exports."""
    return str(uuid.uuid5(EVENT_ID_NAMESPACE, f"tessera:usage:{request_id}"))


def _utc(dt: datetime) -> datetime:
    return dt.replace(tzinfo=timezone.utc) if dt.tzinfo is None else dt.astimezone(timezone.utc)


def _rfc3339(dt: datetime) -> str:
    return _utc(dt).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _amount(picos: int | None) -> Decimal | None:
    return None if picos is None else Decimal(picos).scaleb(-12)


def _item_row(period: Period, tenant: Tenant, item: LineItem, currency: str) -> dict:
    status = "invoiced" if item.invoice_id is not None else ("held" if item.amount_picos is None else "pending")
    return {"period": period.name, "tenant": tenant.name, "usage_day": item.usage_day, "base_model": item.base_model,
            "adapter": item.adapter or None, "priority": item.priority, "requests": item.requests,
            "input_tokens": item.input_tokens, "cached_input_tokens": item.cached_input_tokens,
            "output_tokens": item.output_tokens, "input_price_micros_per_mtok": item.input_price,
            "cached_input_price_micros_per_mtok": item.cached_input_price,
            "output_price_micros_per_mtok": item.output_price,
            "amount_picos": item.amount_picos, "amount": _amount(item.amount_picos), "currency": currency,
            "status": status, "invoice_id": item.invoice_id}


def _write_csv(rows: list[dict], out: Path) -> None:
    with open(out, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(LINE_ITEM_COLUMNS)
        for r in rows:
            w.writerow(["" if r[c] is None else (f"{r[c]:.12f}" if c == "amount" else str(r[c]))
                        for c in LINE_ITEM_COLUMNS])


def _write_parquet(rows: list[dict], out: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([
        ("period", pa.string()), ("tenant", pa.string()), ("usage_day", pa.date32()), ("base_model", pa.string()),
        ("adapter", pa.string()), ("priority", pa.string()), ("requests", pa.int64()),
        ("input_tokens", pa.int64()), ("cached_input_tokens", pa.int64()), ("output_tokens", pa.int64()),
        ("input_price_micros_per_mtok", pa.int64()), ("cached_input_price_micros_per_mtok", pa.int64()),
        ("output_price_micros_per_mtok", pa.int64()),
        ("amount_picos", pa.int64()), ("amount", pa.decimal128(38, 12)), ("currency", pa.string()),
        ("status", pa.string()), ("invoice_id", pa.int64())])
    table = pa.Table.from_pylist(rows, schema=schema)
    pq.write_table(table, out, compression="zstd", write_statistics=True)


def _write_jsonl(session: Session, tenant: Tenant, period: Period, out: Path) -> int:
    e = UsageEvent
    stmt = (select(e.request_id, e.created_at, e.api_key_id, e.model, e.base_model, e.adapter_version, e.priority,
                   e.prompt_tokens, e.cached_tokens, e.completion_tokens, e.status, e.finish_reason)
            .where(e.tenant_id == tenant.id, e.created_at >= period.start_datetime(), e.created_at < period.end_datetime())
            .order_by(e.created_at, e.request_id)
            .execution_options(yield_per=10_000))
    n = 0
    with open(out, "w", encoding="utf-8") as f:
        for (rid, created, key_id, model, base, version, prio, prompt, cached, completion, status,
             finish) in session.execute(stmt):
            adapter = None if version is None else model.split("@", 1)[0]
            event = {"specversion": "1.0", "id": event_id(rid), "source": CLOUDEVENT_SOURCE, "type": CLOUDEVENT_TYPE,
                     "subject": tenant.name, "time": _rfc3339(created), "datacontenttype": "application/json",
                     "data": {"request_id": rid, "tenant": tenant.name, "api_key_id": key_id,
                              "base_model": base or model, "adapter": adapter, "adapter_version": version,
                              "priority": prio, "input_tokens": prompt, "cached_input_tokens": cached,
                              "output_tokens": completion,
                              "total_tokens": prompt + completion, "status": status, "finish_reason": finish}}
            f.write(json.dumps(event, sort_keys=True, separators=(",", ":"), ensure_ascii=False) + "\n")
            n += 1
    return n


def object_key(tenant: Tenant, period: Period, fmt: str) -> str:
    name = "usage-events.jsonl" if fmt == "jsonl" else f"line-items.{fmt}"
    return f"billing/exports/tenant-{tenant.id}/{period.name}/{name}"


def download_name(tenant_name: str, period_start, fmt: str) -> str:
    what = "usage-events" if fmt == "jsonl" else "line-items"
    return f"{tenant_name}-{Period.of(period_start).name}-{what}.{fmt}"


@dataclass
class BuiltExport:
    path: Path
    rows: int
    final: bool


def build_export(session: Session, *, tenant: Tenant, period: Period, fmt: str, currency: str, out_dir: Path) -> BuiltExport:
    """Write the export file into out_dir (nothing stored yet)."""
    if fmt not in EXPORT_FORMATS:
        raise ExportFormatError(f"format must be one of {', '.join(EXPORT_FORMATS)}")
    summary = period_summary(session, tenant_id=tenant.id, period=period)
    final = summary["invoice"] is not None
    out = out_dir / f"export.{fmt}"
    if fmt == "jsonl":
        return BuiltExport(out, _write_jsonl(session, tenant, period, out), final)
    rows = [_item_row(period, tenant, i, currency) for i in summary["line_items"]]
    (_write_csv if fmt == "csv" else _write_parquet)(rows, out)
    return BuiltExport(out, len(rows), final)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_export(session: Session, store: ObjectStore, *, tenant: Tenant, period: Period, fmt: str,
                 currency: str) -> Export:
    """Build the export, put it in the object store and record it (replacing an earlier one of
    the same tenant, period and format); commits. The rows are read in the session's current
    transaction, which ends before the upload; the record is written in a short one of its own
    (on SQLite a transaction that writes holds the database's one write lock)."""
    with tempfile.TemporaryDirectory(prefix="tessera-export-") as tmp:
        built = build_export(session, tenant=tenant, period=period, fmt=fmt, currency=currency, out_dir=Path(tmp))
        session.commit()  # ends the reading transaction; nothing was written in it
        key = object_key(tenant, period, fmt)
        store.put_file(key, built.path)
        values = dict(object_key=key, sha256=_sha256(built.path), size_bytes=built.path.stat().st_size,
                      rows=built.rows, final=built.final, created_at=utcnow())
    for _attempt in range(2):
        row = session.scalar(select(Export).where(Export.tenant_id == tenant.id, Export.period_start == period.start,
                                                  Export.format == fmt))
        if row is None:
            row = Export(tenant_id=tenant.id, period_start=period.start, format=fmt, **values)
            session.add(row)
        else:
            for k, v in values.items():
                setattr(row, k, v)
        try:
            session.commit()
            return row
        except IntegrityError:  # written concurrently: update that record instead
            session.rollback()
    raise RuntimeError("could not record the export")


def list_exports(session: Session, *, tenant_id: int, period: Period | None = None) -> list[Export]:
    where = [Export.tenant_id == tenant_id]
    if period is not None:
        where.append(Export.period_start == period.start)
    return list(session.scalars(select(Export).where(*where).order_by(Export.period_start.desc(), Export.format)))


def fetch_export(store: ObjectStore, export: Export, path: Path) -> None:
    """Copy the stored file to `path` (streamed; a usage-events export can be large)."""
    store.get_file(export.object_key, path)
