"""Usage in time buckets for one tenant, shaped after OpenAI's usage API.

`usage_buckets(session, tenant_id, start_time, end_time, bucket_width, group_by, limit, page)`
returns {"object": "page", "data": [bucket, ...], "has_more", "next_page"} where every bucket of
[start_time, end_time) is present (empty ones too) as
    {"object": "bucket", "start_time", "end_time", "results": [result, ...]}
and each result sums the tenant's usage events in that bucket:
    {"object": "usage.result", "input_tokens", "input_cached_tokens", "output_tokens",
     "num_model_requests", "cost_micros", "amount": {"value", "currency"}, "unpriced_tokens",
     plus, per group_by field: "adapter" (adapter name; null = the base model), "priority",
     "api_key_id", "end_user" (the requests' `user`; null where none was given)}
input_tokens are all prompt tokens and input_cached_tokens those of them the engine's prefix
cache served, as in OpenAI's usage API.
Cost is the tenant's price (its contract price, else the book's, in effect on each event's UTC
day; tessera.billing.prices) times the tokens, summed exactly and rounded once to micro-units
(cached input tokens at the cached_input price, else the input price, as billing does);
it is what billing charges before any included-token credit. When some of a result's tokens
have no price, cost_micros and amount are null and unpriced_tokens counts them (billing holds
those, it never bills them at zero).
Times are unix seconds, start inclusive, end exclusive; 1h buckets start on the hour and 1d
buckets at midnight UTC when start_time does (buckets are counted from start_time). Every event
counts, whatever its status: aborted requests were billed for what they were sent. The sums
run in the database (one GROUP BY over the tenant's events in the range, on its
(tenant_id, created_at) rows, also grouped by day, base model and priority for pricing), not in
Python per event.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime, timezone

from sqlalchemy import BigInteger, cast, func, select
from sqlalchemy.orm import Session

from tessera.billing.invoices import round_picos
from tessera.billing.prices import PriceBook
from tessera.billing.rollup import usage_day
from tessera.models import UsageEvent

BUCKET_SECONDS = {"1h": 3600, "1d": 86400}
GROUP_FIELDS = ("adapter", "priority", "api_key", "end_user")
MAX_BUCKETS = {"1h": 168, "1d": 31}
DEFAULT_BUCKETS = {"1h": 24, "1d": 7}


class UsageQueryError(ValueError):
    """A bad query parameter; the message names it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _epoch(session: Session):
    """created_at as integer unix seconds, in the session's SQL dialect."""
    if session.get_bind().dialect.name == "postgresql":
        return cast(func.floor(func.extract("epoch", UsageEvent.created_at)), BigInteger)
    return cast(func.strftime("%s", UsageEvent.created_at), BigInteger)  # SQLite stores UTC text


@dataclass(frozen=True)
class _Window:
    """The buckets one answer covers: k in [first, last) of `total`, each `width` seconds from
    start_time; events in [lo, hi) count."""

    width: int
    first: int
    last: int
    total: int
    lo: int
    hi: int


def usage_buckets(*, session: Session, tenant_id: int, start_time: int, end_time: int | None,
                  bucket_width: str = "1d", group_by: list[str] | None = None, limit: int | None = None,
                  page: str | None = None, currency: str = "USD") -> dict:
    """See the module docstring. Raises UsageQueryError for a bad parameter."""
    if bucket_width not in BUCKET_SECONDS:
        raise UsageQueryError("bucket_width must be 1h or 1d", "bucket_width")
    group_by = _group_fields(group_by)
    w = _window(start_time=start_time, end_time=end_time, bucket_width=bucket_width, limit=limit, page=page)
    results = _results(session, tenant_id, group_by, start_time, w, currency)
    return _page(results, start_time, end_time, w)


def _group_fields(group_by: list[str] | None) -> list[str]:
    """group_by without repeats; UsageQueryError for a field not in GROUP_FIELDS."""
    group_by = list(dict.fromkeys(group_by or []))
    for g in group_by:
        if g not in GROUP_FIELDS:
            raise UsageQueryError(f"group_by {g!r} is not one of {', '.join(GROUP_FIELDS)}", "group_by")
    return group_by


def _window(*, start_time: int, end_time: int | None, bucket_width: str, limit: int | None,
            page: str | None) -> _Window:
    """The buckets this page covers (bucket_width already checked); UsageQueryError naming the
    bad parameter."""
    width = BUCKET_SECONDS[bucket_width]
    if start_time < 0:
        raise UsageQueryError("start_time must be unix seconds >= 0", "start_time")
    limit = DEFAULT_BUCKETS[bucket_width] if limit is None else limit
    if not 1 <= limit <= MAX_BUCKETS[bucket_width]:
        raise UsageQueryError(f"limit must be between 1 and {MAX_BUCKETS[bucket_width]} for {bucket_width} buckets", "limit")
    try:
        first = int(page) if page else 0
    except ValueError:
        raise UsageQueryError("page must be the next_page value of a previous answer", "page") from None
    total = -(-((end_time if end_time is not None else start_time + limit * width) - start_time) // width)
    if total <= 0:
        raise UsageQueryError("end_time must be after start_time", "end_time")
    if first < 0 or first >= total:
        raise UsageQueryError("page is past the last bucket", "page")
    last = min(total, first + limit)
    lo, hi = start_time + first * width, start_time + last * width
    if end_time is not None:
        hi = min(hi, end_time)
    return _Window(width=width, first=first, last=last, total=total, lo=lo, hi=hi)


def _group_columns(group_by: list[str]) -> list:
    """The usage_events columns the group_by fields group on (adapter: model and version)."""
    cols = []
    if "adapter" in group_by:
        cols += [UsageEvent.model, UsageEvent.adapter_version]
    if "priority" in group_by:
        cols.append(UsageEvent.priority)
    if "api_key" in group_by:
        cols.append(UsageEvent.api_key_id)
    if "end_user" in group_by:
        cols.append(UsageEvent.end_user)
    return cols


def _group_of(keys: list, group_by: list[str]) -> dict:
    """A result's group fields from the values of its _group_columns."""
    group: dict = {}
    i = 0
    if "adapter" in group_by:
        model, version = keys[0], keys[1]
        # One series per adapter name, whichever version or `name@version` the requests named.
        group["adapter"] = model.split("@", 1)[0] if version is not None else None
        i = 2
    if "priority" in group_by:
        group["priority"] = keys[i]
        i += 1
    if "api_key" in group_by:
        group["api_key_id"] = keys[i]
        i += 1
    if "end_user" in group_by:
        group["end_user"] = keys[i]
    return group


def _results(session: Session, tenant_id: int, group_by: list[str], start_time: int, w: _Window,
             currency: str) -> dict[int, dict[tuple, dict]]:
    """{bucket index: {group: result}}, summed in one GROUP BY and priced from the PriceBook."""
    bucket = ((_epoch(session) - start_time) // w.width).label("bucket")
    cols = [bucket, *_group_columns(group_by)]
    book = PriceBook(session, tenant_id)
    results: dict[int, dict[tuple, dict]] = {}
    picos: dict[int, int] = {}  # id(result) -> exact cost
    for row in session.execute(_sums_query(session, tenant_id, cols, w)):
        b, *keys = row[:len(cols)]
        d, base_model, priority = row[len(cols):len(cols) + 3]
        prompt, cached, completion, n = row[len(cols) + 3:]
        group = _group_of(keys, group_by)
        r = results.setdefault(int(b), {}).setdefault(tuple(group.items()), {
            "object": "usage.result", "input_tokens": 0, "input_cached_tokens": 0, "output_tokens": 0,
            "num_model_requests": 0, "cost_micros": None, "amount": None, "unpriced_tokens": 0, **group})
        prompt, cached, completion = int(prompt or 0), int(cached or 0), int(completion or 0)
        r["input_tokens"] += prompt
        r["input_cached_tokens"] += cached
        r["output_tokens"] += completion
        r["num_model_requests"] += int(n)
        d = d if isinstance(d, date) else date.fromisoformat(d)
        input_price = book.price(base_model, priority, "input", d)
        cached_price = book.price(base_model, priority, "cached_input", d)
        for tokens, price in ((prompt - cached, input_price),
                              (cached, input_price if cached_price is None else cached_price),
                              (completion, book.price(base_model, priority, "output", d))):
            if price is None:
                r["unpriced_tokens"] += tokens
            else:
                picos[id(r)] = picos.get(id(r), 0) + tokens * price
    _set_costs(results, picos, currency)
    return results


def _sums_query(session: Session, tenant_id: int, cols: list, w: _Window):
    """SELECT cols, day, base model, priority, prompt, cached and completion token sums, count over the
    tenant's events in [w.lo, w.hi), grouped by all but the sums."""
    # What a price depends on, grouped too (a handful of rows more, priced in Python below).
    day = usage_day(UsageEvent.created_at, session.get_bind().dialect.name)
    pricing = [day, func.coalesce(UsageEvent.base_model, UsageEvent.model), UsageEvent.priority]
    return (select(*cols, *pricing, func.sum(UsageEvent.prompt_tokens), func.sum(UsageEvent.cached_tokens),
                   func.sum(UsageEvent.completion_tokens), func.count())
            .where(UsageEvent.tenant_id == tenant_id,
                   UsageEvent.created_at >= datetime.fromtimestamp(w.lo, timezone.utc),
                   UsageEvent.created_at < datetime.fromtimestamp(w.hi, timezone.utc))
            .group_by(*cols, *pricing))


def _set_costs(results: dict[int, dict[tuple, dict]], picos: dict[int, int], currency: str) -> None:
    """Fill cost_micros and amount of every result with no unpriced tokens (rounded once)."""
    for by_group in results.values():
        for r in by_group.values():
            if r["unpriced_tokens"] == 0:
                r["cost_micros"] = round_picos(picos.get(id(r), 0))
                r["amount"] = {"value": r["cost_micros"] / 1_000_000, "currency": currency.lower()}


def _page(results: dict[int, dict[tuple, dict]], start_time: int, end_time: int | None, w: _Window) -> dict:
    """The answer: every bucket of the window (empty ones too) and the next page's token."""
    data = []
    for k in range(w.first, w.last):
        b_start = start_time + k * w.width
        b_end = b_start + w.width if end_time is None else min(b_start + w.width, end_time)
        data.append({"object": "bucket", "start_time": b_start, "end_time": b_end,
                     "results": list(results.get(k, {}).values())})
    more = w.last < w.total
    return {"object": "page", "data": data, "has_more": more, "next_page": str(w.last) if more else None}
