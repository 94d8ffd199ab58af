"""Quota admission of a completion request, and how its answers read to the tenant.

Two looks at the counters: `refuse_early`, read-only and before any work is spent on the request
(adapter lookup, tokenization), refuses a tenant already over a limit; `admit` then reserves
prompt + max_tokens atomically for the requests that pass. A refusal is a 429 with OpenAI's
x-ratelimit-* headers and Retry-After; counters that cannot be reached are a 503.
"""
from __future__ import annotations

import logging
import time

import anyio
from sqlalchemy.exc import SQLAlchemyError

from tessera.api.completions_request import Body, Job, requested_max_tokens
from tessera.errors import ApiError
from tessera.gateway import Gateway
from tessera.metering import used_in_month
from tessera.quota import Decision, QuotaUnavailable, month_of
from tessera.services import Caller

log = logging.getLogger(__name__)


def ratelimit_headers(d: Decision) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers for the limits the tenant has (none for unlimited ones)."""
    h = {}
    if d.limits.requests_per_minute is not None:
        h["x-ratelimit-limit-requests"] = str(d.limits.requests_per_minute)
        h["x-ratelimit-remaining-requests"] = str(d.remaining_requests)
        h["x-ratelimit-reset-requests"] = _fmt_reset(d.reset_requests_s)
    if d.limits.tokens_per_minute is not None:
        h["x-ratelimit-limit-tokens"] = str(d.limits.tokens_per_minute)
        h["x-ratelimit-remaining-tokens"] = str(d.remaining_tokens)
        h["x-ratelimit-reset-tokens"] = _fmt_reset(d.reset_tokens_s)
    return h


def refusal(d: Decision, tokens: int) -> ApiError:
    """The 429 for a refused Decision of a request reserving `tokens`."""
    headers = ratelimit_headers(d) | {"retry-after": str(int(d.retry_after_s))}
    lim = d.limits
    if d.reason == "budget":
        return ApiError(429, f"you exceeded your monthly token budget ({lim.monthly_token_budget} tokens); "
                             f"this request needs up to {tokens}", type="insufficient_quota",
                        code="insufficient_quota", headers=headers)
    msg = {
        "concurrency": f"too many concurrent requests (limit {lim.max_concurrent_requests})",
        "requests": f"rate limit reached: {lim.requests_per_minute} requests per minute",
        "tokens": f"rate limit reached: {lim.tokens_per_minute} tokens per minute "
                  f"(this request reserves {tokens} = prompt + max_tokens)",
    }[d.reason]
    return ApiError(429, f"{msg}; retry after {int(d.retry_after_s)}s", code="rate_limit_exceeded", headers=headers)


async def refuse_early(*, gw: Gateway, caller: Caller, body: Body) -> None:
    """Raise the 429 `admit` would answer a tenant already over a limit, for the least this
    request can reserve (one prompt token + max_tokens, or + 1 when max_tokens is left to the
    server); return None otherwise. Counts nothing."""
    # Past the context the request is a 400 anyway; never let an absurd max_tokens decide a 429.
    tokens = 1 + min(requested_max_tokens(body) or 1, gw.engine.max_model_len - 1)
    try:
        d = await gw.quota.peek(tenant=str(caller.tenant_id), limits=caller.policy.limits, tokens=tokens)
    except QuotaUnavailable as e:
        raise ApiError(503, f"{e}; try again", type="server_error", code="quota_unavailable") from None
    if d is not None:
        raise refusal(d, tokens)


async def admit(*, gw: Gateway, caller: Caller, job: Job) -> Decision:
    """Reserve prompt + n * max_tokens (the prompt is computed once for all `n` choices) in every
    limit (the Decision's reservation is settled once, by the response); 429 when a limit
    refuses, 503 when the counters cannot be reached."""
    tokens = len(job.prompt_ids) + job.n * job.params.max_tokens
    try:
        if caller.policy.limits.monthly_token_budget is not None:
            await _seed_budget(gw, caller)
        d = await gw.quota.reserve(tenant=str(caller.tenant_id), request_id=job.request_id,
                                   limits=caller.policy.limits, tokens=tokens)
    except QuotaUnavailable as e:
        raise ApiError(503, f"{e}; try again", type="server_error", code="quota_unavailable") from None
    if not d.admitted:
        raise refusal(d, tokens)
    return d


async def _seed_budget(gw: Gateway, caller: Caller) -> None:
    """Once per tenant and month in this process: start the budget counter from the durable
    usage events, so a restart (memory counters) or a flushed Redis forgets no spending."""
    month = month_of(time.time())
    if (caller.tenant_id, month) in gw.seeded_budgets:
        return
    try:
        total = await anyio.to_thread.run_sync(
            lambda: used_in_month(gw.session_factory, tenant_id=caller.tenant_id, month=month))
    except SQLAlchemyError as e:
        log.warning("budget seed of tenant %s: usage database error: %s", caller.tenant_id, type(e).__name__)
        raise ApiError(503, "the usage database is unavailable; try again") from None
    await gw.quota.seed_budget(tenant=str(caller.tenant_id), month=month, used=total)
    gw.seeded_budgets.add((caller.tenant_id, month))


def _fmt_reset(seconds: float) -> str:
    s = max(0, int(round(seconds)))
    return f"{s // 60}m{s % 60}s" if s >= 60 else f"{s}s"
