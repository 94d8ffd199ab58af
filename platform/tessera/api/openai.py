"""The tenant-facing OpenAI-compatible API: /v1/chat/completions, /v1/completions, /v1/models.

One request, cheap checks first: authenticate (auth.py) -> pick the priority class -> refuse a
tenant already over a limit (a read-only look at its counters) -> resolve `model` within the
caller's tenant (base model, adapter name or name@version; another tenant's adapter is the same
404 as an unknown name) -> refuse a prompt whose UTF-8 size alone exceeds the context -> render
and tokenize (off the event loop when long; message contents as plain text, never control
tokens) and check the context -> reserve quota (prompt + max_tokens) -> stream from the engine
-> record one usage event -> settle the quota to the real count.

A server-side failure answers the tenant 503 with what failed in general terms and the request
id; worker URLs, object keys, paths and bucket names go to the log only.

Billing of a client that disconnects mid-stream: the engine request is aborted (its KV blocks
freed) and the usage event (status "aborted") counts the completion tokens the gateway had
forwarded to the client; tokens the engine computed after the disconnect are never forwarded
and never billed. A non-streaming request whose client disconnects before the answer is ready
is aborted the same way (streaming.cancel_on_disconnect) and, having been sent nothing, is
billed its prompt tokens only.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError

from adapter_registry import services as registry
from adapter_registry.errors import NotFound, RegistryError
from adapter_registry.models import Tenant
from engine.sampling_params import GenerationRequest, InvalidRequestError, Priority, RequestOutput, SamplingParams
from engine.tokenizer import ChatTemplateError, PromptTooLong
from tessera.api.schemas import ChatCompletionRequest, CompletionRequest
from tessera.auth import CallerDep, GatewayDep
from tessera.engine_client import EngineUnavailable
from tessera.errors import ApiError, scrub
from tessera.gateway import Gateway
from tessera.metering import Usage
from tessera.models import UsageEvent
from tessera.quota import Decision, QuotaUnavailable, month_of
from tessera.services import Caller
from tessera.streaming import ClientDisconnected, DisconnectAwareStream, Final, cancel_on_disconnect

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1")

#: Prompts up to this many characters are tokenized on the event loop (tens of microseconds,
#: less than a hop to a worker thread); longer ones on a worker thread, so one tenant's large
#: prompt never stalls the other requests this process serves.
INLINE_TOKENIZE_CHARS = 2048

_FINISH = {"stop": "stop", "length": "length", "abort": "stop", "error": "stop"}


# ------------------------------------------------------------------ models


def _model_not_found(name: str) -> ApiError:
    return ApiError(404, f"The model '{name}' does not exist or you do not have access to it.",
                    param="model", code="model_not_found")


def _unavailable(request_id: str | None, what: str, detail: object, *, code: str = "service_unavailable") -> ApiError:
    """A tenant-facing 503 that says what failed in general terms and the request id; the
    details (worker URLs, paths, bucket names) go to the server log only."""
    log.warning("request %s: %s: %s", request_id or "-", what, detail)
    ref = f" (request id {request_id})" if request_id else ""
    return ApiError(503, f"{what}; try again{ref}", type="server_error", code=code)


async def _resolve_adapter(gw: Gateway, caller: Caller, model: str, request_id: str | None = None) -> str | None:
    """The adapter version id (sha256) `model` names for this caller; None for the base model."""
    if model == gw.engine.model_name:
        return None

    def resolve() -> str:
        with gw.session_factory() as session:
            tenant = session.get(Tenant, caller.tenant_id)
            return registry.resolve_version(session=session, tenant=tenant, ref=model).sha256

    try:
        return await anyio.to_thread.run_sync(resolve)
    except NotFound:
        raise _model_not_found(model) from None
    except RegistryError as e:
        if e.http_status >= 500:
            raise _unavailable(request_id, "the adapter registry is unavailable", e) from None
        raise ApiError(e.http_status, str(e), param="model") from None
    except SQLAlchemyError as e:
        raise _unavailable(request_id, "the adapter registry is unavailable", type(e).__name__) from None


def _model_obj(id: str, owned_by: str, created: float | None = None) -> dict:
    return {"id": id, "object": "model", "created": int(created or 0), "owned_by": owned_by}


@router.get("/models")
async def list_models(caller: CallerDep, gw: GatewayDep):
    """The base model and the caller's own adapters that have a ready version."""

    def adapters() -> list[dict]:
        with gw.session_factory() as session:
            tenant = session.get(Tenant, caller.tenant_id)
            return [_model_obj(a.name, caller.tenant_name, a.created_at.timestamp())
                    for a in registry.list_adapters(session=session, tenant=tenant) if a.current_version_id]

    data = [_model_obj(gw.engine.model_name, "tessera")] + await anyio.to_thread.run_sync(adapters)
    return {"object": "list", "data": data}


@router.get("/models/{model:path}")
async def get_model(model: str, caller: CallerDep, gw: GatewayDep):
    """One model the caller may use (base, adapter name or name@version); 404 otherwise."""
    await _resolve_adapter(gw, caller, model)
    return _model_obj(model, "tessera" if model == gw.engine.model_name else caller.tenant_name)


# ------------------------------------------------------------------ completions


@dataclass
class _Job:
    """Everything the engine call and the usage event need, fixed before admission."""

    kind: str  # "chat" | "text"
    request_id: str
    model: str
    adapter: str | None
    priority: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    started: float = field(default_factory=time.perf_counter)
    created: int = field(default_factory=lambda: int(time.time()))


def _priority(caller: Caller, requested: str | None) -> str:
    name = requested or caller.policy.default_priority
    try:
        Priority.parse(name)
    except InvalidRequestError as e:
        raise ApiError(400, e.message, param="priority", code="invalid_priority") from None
    if name not in caller.policy.allowed_priorities:
        raise ApiError(403, f"priority class {name!r} is not allowed on plan {caller.policy.plan!r} "
                            f"(allowed: {', '.join(caller.policy.allowed_priorities)})",
                       param="priority", code="priority_not_allowed")
    return name


def _text_chars(body: ChatCompletionRequest | CompletionRequest) -> int:
    if isinstance(body, ChatCompletionRequest):
        return sum(len(m.text()) for m in body.messages)
    if isinstance(body.prompt, str):
        return len(body.prompt)
    return sum(len(x) for x in body.prompt if isinstance(x, str))


async def _prompt_ids(gw: Gateway, body: ChatCompletionRequest | CompletionRequest) -> list[int]:
    """The prompt's token ids: on the event loop when short, else on a worker thread."""
    if _text_chars(body) <= INLINE_TOKENIZE_CHARS:
        return _tokenize(gw, body)
    return await anyio.to_thread.run_sync(_tokenize, gw, body)


def _tokenize(gw: Gateway, body: ChatCompletionRequest | CompletionRequest) -> list[int]:
    """Render (chat) and encode the prompt. A prompt whose UTF-8 size alone shows it cannot fit
    the context is refused before encoding (400 context_length_exceeded). Messages' contents
    are text: special tokens written in them never become control tokens."""
    tok = gw.engine.tokenizer
    chat = isinstance(body, ChatCompletionRequest)
    param = "messages" if chat else "prompt"
    ctx = gw.engine.max_model_len
    most = ctx - 1  # the prompt must leave room for one generated token
    try:
        if chat:
            ids = tok.encode_chat([{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                                   for m in body.messages], max_tokens=most)
        elif isinstance(body.prompt, str):
            tok.check_fits(body.prompt, most)
            ids = tok.encode(body.prompt) if body.prompt else []
        elif body.prompt and all(isinstance(x, str) for x in body.prompt):
            if len(body.prompt) != 1:
                raise ApiError(400, "only one prompt per request is supported", param="prompt")
            tok.check_fits(body.prompt[0], most)
            ids = tok.encode(body.prompt[0]) if body.prompt[0] else []
        else:
            ids = list(body.prompt)
            vocab = tok.vocab_size
            if any(t < 0 or t >= vocab for t in ids):
                raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
    except ChatTemplateError as e:
        raise ApiError(400, f"messages: {e}", param="messages") from None
    except PromptTooLong as e:
        raise ApiError(400, f"the prompt has at least {e.min_tokens} tokens; this model's context is {ctx} tokens",
                       param=param, code="context_length_exceeded") from None
    if not ids:
        raise ApiError(400, "the prompt is empty", param=param)
    return ids


def _params(gw: Gateway, body, n_prompt: int) -> SamplingParams:
    ctx = gw.engine.max_model_len
    if n_prompt >= ctx:
        raise ApiError(400, f"the prompt has {n_prompt} tokens; this model's context is {ctx} tokens",
                       param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                       code="context_length_exceeded")
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
    if max_tokens is None:
        max_tokens = min(gw.settings.default_max_tokens, ctx - n_prompt)
    elif n_prompt + max_tokens > ctx:
        raise ApiError(400, f"max_tokens is too large: the prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) "
                            f"exceeds this model's context of {ctx} tokens", param="max_tokens",
                       code="context_length_exceeded")
    if body.n != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    if body.presence_penalty or body.frequency_penalty:
        raise ApiError(400, "presence_penalty and frequency_penalty are not supported (use 0)", param="presence_penalty")
    if isinstance(body, CompletionRequest) and body.echo:
        raise ApiError(400, "echo is not supported", param="echo")
    raw = {"max_tokens": max_tokens}
    for name in ("temperature", "top_p", "top_k", "seed"):
        if getattr(body, name) is not None:
            raw[name] = getattr(body, name)
    if body.stop is not None:
        raw["stop"] = [body.stop] if isinstance(body.stop, str) else body.stop
    try:
        return SamplingParams.from_dict(raw)
    except InvalidRequestError as e:
        raise ApiError(400, e.message, param=e.param) from None


def _fmt_reset(seconds: float) -> str:
    s = max(0, int(round(seconds)))
    return f"{s // 60}m{s % 60}s" if s >= 60 else f"{s}s"


def _ratelimit_headers(d: Decision) -> dict[str, str]:
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


def _refusal(d: Decision, tokens: int) -> ApiError:
    headers = _ratelimit_headers(d) | {"retry-after": str(int(d.retry_after_s))}
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


async def _seed_budget(gw: Gateway, caller: Caller) -> None:
    """Once per tenant and month in this process: start the budget counter from the durable
    usage events, so a restart (memory counters) or a flushed Redis forgets no spending."""
    month = month_of(time.time())
    if (caller.tenant_id, month) in gw.seeded_budgets:
        return

    def used() -> int:
        year, mon = map(int, month.split("-"))
        since = datetime(year, mon, 1, tzinfo=timezone.utc)
        with gw.session_factory() as session:
            return int(session.scalar(
                select(func.coalesce(func.sum(UsageEvent.prompt_tokens + UsageEvent.completion_tokens), 0))
                .where(UsageEvent.tenant_id == caller.tenant_id, UsageEvent.created_at >= since)))

    try:
        total = await anyio.to_thread.run_sync(used)
    except SQLAlchemyError as e:
        log.warning("budget seed of tenant %s: usage database error: %s", caller.tenant_id, type(e).__name__)
        raise ApiError(503, "the usage database is unavailable; try again") from None
    await gw.quota.seed_budget(tenant=str(caller.tenant_id), month=month, used=total)
    gw.seeded_budgets.add((caller.tenant_id, month))


async def _refuse_early(gw: Gateway, caller: Caller, body) -> None:
    """Refuse a tenant that is already over a limit before any work is spent on its request
    (adapter lookup, tokenization): a read-only look at the counters for the least this request
    can reserve (one prompt token + max_tokens, or + 1 when max_tokens is left to the server).
    `_admit` still reserves atomically for the requests that pass."""
    peek = getattr(gw.quota, "peek", None)
    if peek is None:
        return
    explicit = getattr(body, "max_completion_tokens", None) or body.max_tokens
    # Past the context the request is a 400 anyway; never let an absurd max_tokens decide a 429.
    tokens = 1 + min(explicit or 1, gw.engine.max_model_len - 1)
    try:
        d = await peek(tenant=str(caller.tenant_id), limits=caller.policy.limits, tokens=tokens)
    except QuotaUnavailable as e:
        raise ApiError(503, f"{e}; try again", type="server_error", code="quota_unavailable") from None
    if d is None:
        return
    metrics = getattr(gw.quota, "metrics", None)  # RefusalCountingQuota counts reserve's refusals only
    if metrics is not None:
        try:
            await metrics.refused(str(caller.tenant_id), d.reason)
        except Exception:  # noqa: BLE001 - a metric must never fail a request
            log.warning("metrics: could not count a quota refusal", exc_info=True)
    raise _refusal(d, tokens)


async def _admit(gw: Gateway, caller: Caller, job: _Job) -> Decision:
    tokens = len(job.prompt_ids) + job.params.max_tokens
    try:
        if caller.policy.limits.monthly_token_budget is not None:
            await _seed_budget(gw, caller)
        d = await gw.quota.reserve(tenant=str(caller.tenant_id), request_id=job.request_id,
                                   limits=caller.policy.limits, tokens=tokens)
    except QuotaUnavailable as e:
        raise ApiError(503, f"{e}; try again", type="server_error", code="quota_unavailable") from None
    if not d.admitted:
        raise _refusal(d, tokens)
    return d


async def _finish(gw: Gateway, caller: Caller, job: _Job, decision: Decision, *, status: str,
                  finish_reason: str | None, completion_tokens: int, ttft: float | None) -> Usage:
    """Record the usage event, then settle the quota to the tokens really used (shielded: runs
    even when the request is being cancelled)."""
    with anyio.CancelScope(shield=True):
        prompt = len(job.prompt_ids) if status != "error" or completion_tokens else 0
        usage = Usage(request_id=job.request_id, tenant_id=caller.tenant_id, api_key_id=caller.key_id,
                      model=job.model, adapter_version=job.adapter, priority=job.priority,
                      prompt_tokens=prompt, completion_tokens=completion_tokens, status=status,
                      finish_reason=finish_reason, ttft_ms=None if ttft is None else ttft * 1000.0,
                      duration_ms=(time.perf_counter() - job.started) * 1000.0,
                      base_model=gw.engine.model_name)
        await gw.meter.record(usage)
        await gw.quota.settle(decision.reservation, used_tokens=prompt + completion_tokens)
        return usage


def _engine_error(job: _Job, out: RequestOutput) -> ApiError:
    """The engine failed this request (its adapter could not be loaded, a step fault traced to
    it): the reason without internal paths or addresses, and the request id; logged whole."""
    log.warning("request %s: the engine failed it: %s", job.request_id, out.error)
    reason = scrub(out.error or "engine error")
    if out.adapter_fault:
        # The tenant's adapter made the model's numbers non-finite: the version is quarantined
        # (every later request for it is a 409 too), and the platform itself is fine.
        return ApiError(409, f"the adapter of model {job.model!r} failed this request and is quarantined: {reason} "
                             f"(request id {job.request_id})", param="model", code="adapter_quarantined")
    return ApiError(503, f"the engine could not complete the request: {reason} (request id {job.request_id})",
                    type="server_error", code="engine_error")


def _usage_dict(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _chunk(job: _Job, text: str | None, finish: str | None, *, first: bool = False) -> dict:
    if job.kind == "chat":
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text is not None else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    c = {"id": job.request_id, "object": obj, "created": job.created, "model": job.model, "choices": [choice]}
    if job.include_usage:
        c["usage"] = None
    return c


def _sse(data: dict | str) -> bytes:
    return b"data: " + (data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))).encode() + b"\n\n"


async def _serve(gw: Gateway, caller: Caller, body, kind: str, http: Request):
    request_id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
    priority = _priority(caller, body.priority)
    await _refuse_early(gw, caller, body)
    adapter = await _resolve_adapter(gw, caller, body.model, request_id)
    ids = await _prompt_ids(gw, body)
    params = _params(gw, body, len(ids))
    job = _Job(kind=kind, request_id=request_id, model=body.model, adapter=adapter, priority=priority,
               prompt_ids=ids, params=params, stream=body.stream,
               include_usage=bool(body.stream and body.stream_options and body.stream_options.include_usage))
    decision = await _admit(gw, caller, job)
    headers = _ratelimit_headers(decision) | {"x-request-id": job.request_id}
    request = GenerationRequest(request_id=job.request_id, prompt_token_ids=ids, params=params,
                                tenant_id=str(caller.tenant_id), priority=Priority.parse(priority), adapter=adapter)
    stream = gw.engine.generate(request)
    # Wait for the first delta before answering, so a refusal is a 4xx/503, not a broken stream.
    try:
        first = await stream.__anext__()
    except InvalidRequestError as e:
        # The caller's mistake, caught by the engine before any work: nothing to bill, and not a
        # server error (a usage event with status "error" would count against availability
        # SLOs). Release the reservation like every other 4xx, which never reaches the engine.
        with anyio.CancelScope(shield=True):
            await gw.quota.settle(decision.reservation, used_tokens=0)
        raise ApiError(400, e.message, param=e.param) from None
    except EngineUnavailable as e:
        await _finish(gw, caller, job, decision, status="error", finish_reason=None, completion_tokens=0, ttft=None)
        raise _unavailable(job.request_id, "no engine is available", e, code="engine_unavailable") from None
    except BaseException:
        await stream.aclose()
        await _finish(gw, caller, job, decision, status="aborted", finish_reason=None, completion_tokens=0, ttft=None)
        raise
    if first.finished and first.finish_reason == "error":
        # Failed before any token (its adapter could not be loaded): an error status, streaming
        # or not, rather than a 200 whose only event is the error.
        await _finish(gw, caller, job, decision, status="error", finish_reason="error",
                      completion_tokens=len(first.token_ids), ttft=None)
        raise _engine_error(job, first)
    ttft = time.perf_counter() - job.started
    if job.stream:
        return DisconnectAwareStream(_events(gw, caller, job, decision, stream, first, ttft),
                                     media_type="text/event-stream",
                                     headers=headers | {"cache-control": "no-cache", "x-accel-buffering": "no"})

    async def collect() -> Response:
        # An error answer is returned, not raised: raised inside cancel_on_disconnect's task
        # group it would reach the app wrapped in an exception group, as a 500.
        try:
            return await _collect(gw, caller, job, decision, stream, first, ttft, headers)
        except ApiError as e:
            return e.response()

    try:
        return await cancel_on_disconnect(http.receive, collect)
    except ClientDisconnected:
        return Response(status_code=499)  # nobody reads it; the usage event says "aborted"


async def _collect(gw, caller, job, decision, stream, first, ttft, headers) -> JSONResponse:
    parts, out, completion = [], first, 0
    try:
        while True:
            parts.append(out.text)
            completion += len(out.token_ids)
            if out.finished:
                break
            out = await stream.__anext__()
    except EngineUnavailable as e:
        await _finish(gw, caller, job, decision, status="error", finish_reason=None,
                      completion_tokens=completion, ttft=ttft)
        raise _unavailable(job.request_id, "the engine failed mid-request", e, code="engine_unavailable") from None
    except BaseException:  # cancelled: the client went away before the answer was ready
        await stream.aclose()
        # Billed for what it was sent, as a stream that disconnects is: here nothing.
        await _finish(gw, caller, job, decision, status="aborted", finish_reason=None,
                      completion_tokens=0, ttft=ttft)
        raise
    if out.finish_reason == "error":
        await _finish(gw, caller, job, decision, status="error", finish_reason="error",
                      completion_tokens=completion, ttft=ttft)
        raise _engine_error(job, out)
    await _finish(gw, caller, job, decision, status="completed", finish_reason=out.finish_reason,
                  completion_tokens=completion, ttft=ttft)
    text = "".join(parts)
    finish = _FINISH.get(out.finish_reason, "stop")
    if job.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return JSONResponse({"id": job.request_id, "object": obj, "created": job.created, "model": job.model,
                         "choices": [choice], "usage": _usage_dict(len(job.prompt_ids), completion)}, headers=headers)


async def _events(gw, caller, job, decision, stream, first, ttft):
    """SSE body: one chunk per engine delta, the usage chunk if asked, then [DONE]. Chunks produced
    at the same moment go out in one write (the role chunk with the first delta; the last delta,
    usage, [DONE] and the end of the body together). The usage event is durable before the last
    write; on a disconnect the `finally` records what was forwarded."""
    completion, done = 0, False
    try:
        pending = _sse(_chunk(job, None, None, first=True)) if job.kind == "chat" else b""
        out = first
        while True:
            completion += len(out.token_ids)  # counted as forwarded: the chunk is written next
            if out.finished:
                break
            if out.text:
                yield pending + _sse(_chunk(job, out.text, None))
                pending = b""
            out = await stream.__anext__()
        done = True
        if out.finish_reason == "error":
            await _finish(gw, caller, job, decision, status="error", finish_reason="error",
                          completion_tokens=completion, ttft=ttft)
            yield Final(pending + _sse(_engine_error(job, out).body()))
            return
        finish = _FINISH.get(out.finish_reason, "stop")
        if job.kind == "chat":
            if out.text:
                pending += _sse(_chunk(job, out.text, None))
            pending += _sse(_chunk(job, None, finish))
        else:
            pending += _sse(_chunk(job, out.text, finish))
        await _finish(gw, caller, job, decision, status="completed", finish_reason=out.finish_reason,
                      completion_tokens=completion, ttft=ttft)
        if job.include_usage:
            pending += _sse({"id": job.request_id, "created": job.created, "model": job.model, "choices": [],
                             "object": "chat.completion.chunk" if job.kind == "chat" else "text_completion",
                             "usage": _usage_dict(len(job.prompt_ids), completion)})
        yield Final(pending + _sse("[DONE]"))
    except EngineUnavailable as e:
        if not done:
            done = True
            await _finish(gw, caller, job, decision, status="error", finish_reason=None,
                          completion_tokens=completion, ttft=ttft)
            yield Final(_sse(_unavailable(job.request_id, "the engine failed mid-request", e,
                                          code="engine_unavailable").body()))
    finally:
        with anyio.CancelScope(shield=True):
            await stream.aclose()  # aborts the engine request if it is still running
            if not done:
                await _finish(gw, caller, job, decision, status="aborted", finish_reason="abort",
                              completion_tokens=completion, ttft=ttft)


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, caller: CallerDep, gw: GatewayDep, request: Request):
    """OpenAI chat completions, streaming (SSE) or not."""
    return await _serve(gw, caller, body, "chat", request)


@router.post("/completions")
async def completions(body: CompletionRequest, caller: CallerDep, gw: GatewayDep, request: Request):
    """OpenAI (legacy) text completions, streaming (SSE) or not."""
    return await _serve(gw, caller, body, "text", request)
