"""The tenant-facing OpenAI-compatible API: /v1/chat/completions, /v1/completions, /v1/models.

One request, cheap checks first (`serve_completion`): its JSON text is valid Unicode (body_text.py,
for every route) -> authenticate (auth.py) -> pick the
priority class -> refuse a tenant already over a limit (a read-only look at its counters) ->
resolve `model` within the caller's tenant (base model, adapter name or name@version; another
tenant's adapter is the same 404 as an unknown name) -> refuse a prompt whose UTF-8 size alone
exceeds the context -> render and tokenize (off the event loop when long; message contents as
plain text, never control tokens) and check the prompt and sampling fields -> compile and probe
the response_format's grammar (a 400 naming it when it cannot be served) -> reserve quota
(prompt + n * max_tokens) -> stream from the engine -> record one usage event -> settle the quota to
the real count.

Where each step lives: completions_request.py (priority, prompt, sampling parameters),
admission.py (quota: the early refusal, the reservation, 429 answers), model_resolution.py,
generation.py (the engine call, SSE or JSON answer, usage and settling; billing of clients that
disconnect), failures.py (503s that name the request id; internal details go to the log only).
"""
from __future__ import annotations

import uuid

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import Response

from tessera.api import admission, generation
from tessera.api import completions_request as checks
from tessera.api import response_models as out
from tessera.api.completions_request import Body, Job
from tessera.api.model_resolution import base_model_card, model_card, models_of, resolve_adapter
from tessera.api.schemas import ChatCompletionRequest, CompletionRequest
from tessera.auth import CallerDep, GatewayDep
from tessera.gateway import Gateway
from tessera.observability import tracing
from tessera.services import Caller
from tessera.streaming import ClientDisconnected, cancel_on_disconnect

router = APIRouter(prefix="/v1")


@router.get("/models", response_model=out.ModelList, response_model_exclude_unset=True)
async def list_models(caller: CallerDep, gw: GatewayDep):
    """The base model and the caller's own adapters that have a ready version."""
    return {"object": "list", "data": await models_of(gw=gw, caller=caller)}


@router.get("/models/{model:path}", response_model=out.Model, response_model_exclude_unset=True)
async def get_model(model: str, caller: CallerDep, gw: GatewayDep):
    """One model the caller may use (base, adapter name or name@version); 404 otherwise."""
    await resolve_adapter(gw=gw, caller=caller, model=model)
    return base_model_card(gw) if model == gw.engine.model_name else model_card(model, caller.tenant_name)


async def start_generation(*, gw: Gateway, caller: Caller, body: Body, kind: str,
                           request_id: str | None = None) -> generation.Generation:
    """Every check of a completion request (`kind` "chat" or "text") in the order of the module
    docstring, then its engine requests, up to their first deltas (generation.start). Every
    refusal is an ApiError raised before any quota is held, or after settling it. Also the entry
    point of the Responses API (api/responses.py), which runs as a chat request."""
    request_id = request_id or ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
    priority = checks.priority_of(caller, body.priority)
    tracing.annotate(request_id=request_id, tenant=caller.tenant_name, tenant_id=caller.tenant_id, model=body.model,
                     priority=priority)
    with tracing.span("quota.peek"):
        await admission.refuse_early(gw=gw, caller=caller, body=body)
    with tracing.span("model.resolve") as span:
        adapter = await resolve_adapter(gw=gw, caller=caller, model=body.model, request_id=request_id)
        span.set_attribute("tessera.adapter_version", adapter or "")
    tracing.annotate(adapter_version=adapter)
    tool_plan, fmt = checks.tools_of(gw, body)
    ids = await checks.prompt_ids(gw, body, (tool_plan, fmt))
    params = checks.sampling_params(gw, body, ids, tool_plan, fmt)
    await checks.check_grammar(gw, params)
    options = body.stream_options
    job = Job(kind=kind, request_id=request_id, model=body.model, adapter=adapter, priority=priority,
              prompt_ids=ids, params=params, stream=body.stream,
              include_usage=bool(body.stream and options and options.include_usage),
              continuous_usage=bool(body.stream and options and options.continuous_usage_stats),
              n=body.n, user=body.user, safety_identifier=body.safety_identifier,
              tools=tool_plan if tool_plan is not None and tool_plan.offered else None, tool_format=fmt)
    # Shielded: a disconnect must not leave a reservation unsettled.
    with anyio.CancelScope(shield=True), tracing.span("quota.reserve"):
        decision = await admission.admit(gw=gw, caller=caller, job=job)
    headers = admission.ratelimit_headers(decision) | {"x-request-id": request_id}
    return await generation.start(gw=gw, caller=caller, job=job, decision=decision, headers=headers)


async def serve_completion(*, gw: Gateway, caller: Caller, body: Body, kind: str, http: Request) -> Response:
    """Answer one completion request (`kind` "chat" or "text"): `start_generation` (given up,
    and its engine requests aborted, if the client disconnects first), then the SSE stream or
    the JSON body (generation.respond)."""
    try:
        gen = await cancel_on_disconnect(
            http.receive, lambda: start_generation(gw=gw, caller=caller, body=body, kind=kind))
    except ClientDisconnected:
        return Response(status_code=499)  # nobody reads it; the usage event says "aborted"
    return await generation.respond(gen, http)


@router.post("/chat/completions", response_model=out.ChatCompletion, responses={200: {"content": out.SSE_CONTENT}})
async def chat_completions(body: ChatCompletionRequest, caller: CallerDep, gw: GatewayDep, request: Request):
    """OpenAI chat completions, streaming (SSE) or not."""
    return await serve_completion(gw=gw, caller=caller, body=body, kind="chat", http=request)


@router.post("/completions", response_model=out.Completion, responses={200: {"content": out.SSE_CONTENT}})
async def completions(body: CompletionRequest, caller: CallerDep, gw: GatewayDep, request: Request):
    """OpenAI (legacy) text completions, streaming (SSE) or not."""
    return await serve_completion(gw=gw, caller=caller, body=body, kind="text", http=request)
