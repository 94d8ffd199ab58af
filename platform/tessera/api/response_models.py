"""The response bodies of every route, as Pydantic models: the OpenAPI document's contract.

Routes declare them with `response_model=` (a dict a handler returns is validated and
serialized through its model) or, where a handler answers a Response itself (the completions,
SSE streams, file downloads), with `response_model=` / `responses=` for the document only.
Every error is OpenAI's shape (`ErrorResponse`); `ERROR_RESPONSES` declares it for 4xx and 5xx
on every route (app.py passes it to the app).

Names follow OpenAI's where the shape is theirs (ChatCompletion, Completion, CompletionUsage,
Model, Response, ...). The tenant-facing OpenAI objects allow fields beyond those declared, as
OpenAI's own SDK models do; the admin ones declare exactly the fields their routes return (a
route whose fields come and go sets `response_model_exclude_unset=True`, so an absent field
stays absent rather than answered as null).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from tessera.billing.rollup import HeldUsage  # the rollup's own record, answered as it is


class OpenAIObject(BaseModel):
    """A tenant-facing object of OpenAI's: fields beyond the declared ones are kept."""

    model_config = ConfigDict(extra="allow")


# --- errors -----------------------------------------------------------------------------------

class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error answer: {"error": {"message", "type", "param", "code"}} (tessera.errors)."""

    error: ErrorDetail


#: The error answers every route may give, for `FastAPI(responses=...)`.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorResponse, "description": "Refused: OpenAI's error shape, `param` naming the field"},
    "5XX": {"model": ErrorResponse, "description": "Unavailable or failed: OpenAI's error shape"},
}

#: An SSE alternative to a JSON answer (`stream: true`), for `responses={200: ...}`.
SSE_CONTENT = {"text/event-stream": {"schema": {"type": "string", "description": "Server-sent events: "
                                                "`data:` lines of JSON objects, then `data: [DONE]` (chat and "
                                                "completions) or a final `response.*` event (Responses API)"}}}


# --- /v1/models -------------------------------------------------------------------------------

class Model(OpenAIObject):
    """One entry of /v1/models. The base model's adds `max_model_len` and `architecture`."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = None
    architecture: str | None = None


class ModelList(OpenAIObject):
    object: Literal["list"]
    data: list[Model]


# --- chat.completion, text_completion ---------------------------------------------------------

class PromptTokensDetails(OpenAIObject):
    cached_tokens: int


class CompletionUsage(OpenAIObject):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(OpenAIObject):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatCompletionTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(OpenAIObject):
    content: list[ChatCompletionTokenLogprob] | None
    refusal: str | None = None


class Function(OpenAIObject):
    name: str
    arguments: str


class ChatCompletionMessageToolCall(OpenAIObject):
    id: str
    type: Literal["function"]
    function: Function


class ChatCompletionMessage(OpenAIObject):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ChatCompletionMessageToolCall] | None = None


class ChatCompletionChoice(OpenAIObject):
    index: int
    message: ChatCompletionMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: str


class ChatCompletion(OpenAIObject):
    """POST /v1/chat/completions without `stream` (with it: chat.completion.chunk events)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: CompletionUsage


class Logprobs(OpenAIObject):
    """A text completion's logprobs (OpenAI's legacy shape)."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(OpenAIObject):
    index: int
    text: str
    logprobs: Logprobs | None
    finish_reason: str


class Completion(OpenAIObject):
    """POST /v1/completions without `stream` (with it: text_completion events)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage


# --- /v1/responses ----------------------------------------------------------------------------

class ResponseOutputText(OpenAIObject):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class ResponseOutputMessage(OpenAIObject):
    id: str
    type: Literal["message"]
    status: str
    role: Literal["assistant"]
    content: list[ResponseOutputText]


class ResponseFunctionToolCall(OpenAIObject):
    id: str
    type: Literal["function_call"]
    status: str
    call_id: str
    name: str
    arguments: str


ResponseOutputItem = Annotated[Union[ResponseOutputMessage, ResponseFunctionToolCall], Field(discriminator="type")]


class InputTokensDetails(OpenAIObject):
    cached_tokens: int


class OutputTokensDetails(OpenAIObject):
    reasoning_tokens: int


class ResponseUsage(OpenAIObject):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(OpenAIObject):
    code: str
    message: str


class IncompleteDetails(OpenAIObject):
    reason: str


class Response(OpenAIObject):
    """OpenAI's `response` object: POST /v1/responses (without `stream`) and GET /v1/responses/{id};
    the request's echo fields (temperature, tools, text, ...) as OpenAI answers them."""

    id: str
    object: Literal["response"]
    created_at: int
    status: str
    completed_at: int | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    model: str
    output: list[ResponseOutputItem]
    previous_response_id: str | None
    usage: ResponseUsage | None
    metadata: dict[str, Any] | None
    store: bool
    background: bool | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_key: str | None = None
    reasoning: dict[str, Any] | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    temperature: float | None = None
    text: dict[str, Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    top_logprobs: int | None = None
    top_p: float | None = None
    truncation: str | None = None
    user: str | None = None


class ResponseDeleted(OpenAIObject):
    id: str
    object: Literal["response"]
    deleted: bool


# --- /v1/usage and the admin's usage buckets (tessera.usage_query) ----------------------------

class UsageAmount(BaseModel):
    value: float
    currency: str


class UsageResult(BaseModel):
    """One group's sums in a bucket; the group_by fields only when grouped by them."""

    object: Literal["usage.result"]
    input_tokens: int
    input_cached_tokens: int
    output_tokens: int
    num_model_requests: int
    cost_micros: int | None
    amount: UsageAmount | None
    unpriced_tokens: int
    adapter: str | None = None
    priority: str | None = None
    api_key_id: int | None = None
    end_user: str | None = None


class UsageBucket(BaseModel):
    object: Literal["bucket"]
    start_time: int
    end_time: int
    results: list[UsageResult]


class UsagePage(BaseModel):
    object: Literal["page"]
    data: list[UsageBucket]
    has_more: bool
    next_page: str | None


# --- probes -----------------------------------------------------------------------------------

class EngineReadiness(BaseModel):
    ready: bool
    state: str
    reason: str | None
    restarts: int | None = None  # absent before the gateway started, and for a client that cannot tell
    engines: dict[str, str] | None = None  # HTTP mode: worker-<i> -> its state


class Health(BaseModel):
    status: Literal["ok"]
    engine: EngineReadiness


# --- admin: plans, tenants, keys (api/admin.py, api/admin_tenants.py) -------------------------

class Policy(BaseModel):
    """A tenant's effective limits (None: unlimited) and priority classes."""

    plan: str
    requests_per_minute: int | None
    tokens_per_minute: int | None
    max_concurrent_requests: int | None
    monthly_token_budget: int | None
    allowed_priorities: list[str]
    default_priority: str


class Plan(BaseModel):
    name: str
    requests_per_minute: int | None
    tokens_per_minute: int | None
    max_concurrent_requests: int | None
    monthly_token_budget: int | None
    allowed_priorities: list[str]
    default_priority: str
    monthly_included_tokens: int | None
    scheduling_weight: float


class PlanList(BaseModel):
    data: list[Plan]
    priority_classes: list[str]
    default_plan: str


class TenantOverrides(BaseModel):
    """The tenant's own values over its plan's (None: the plan's)."""

    requests_per_minute: int | None
    tokens_per_minute: int | None
    max_concurrent_requests: int | None
    monthly_token_budget: int | None
    allowed_priorities: list[str] | None
    default_priority: str | None


class TenantCreated(BaseModel):
    id: int
    name: str
    policy: Policy


class Tenant(BaseModel):
    """A tenant as the admin API lists it; `policy` and `overrides` are null for a tenant the
    registry made alone (a CLI upload), which has no plan yet."""

    id: int
    name: str
    status: str
    created_at: str | None
    policy: Policy | None
    overrides: TenantOverrides | None
    active_keys: int
    adapters: int


class TenantList(BaseModel):
    data: list[Tenant]


class ApiKeyIssued(BaseModel):
    """A new key: `key` is in this answer only."""

    id: int
    tenant: str
    name: str | None
    prefix: str
    key: str


class ApiKeyRevoked(BaseModel):
    id: int
    revoked_at: str


class ApiKey(BaseModel):
    id: int
    name: str | None
    prefix: str
    created_at: str | None
    revoked_at: str | None


class ApiKeyList(BaseModel):
    tenant: str
    data: list[ApiKey]


class StatusTotals(BaseModel):
    requests: int
    prompt_tokens: int
    completion_tokens: int


class TenantUsageTotals(BaseModel):
    tenant: str
    by_status: dict[str, StatusTotals]


# --- admin: adapters (api/admin_adapters.py) --------------------------------------------------

class AdapterVersion(BaseModel):
    version: int
    ref: str
    status: str  # validating | ready | rejected | quarantined
    rejection_reason: str | None
    current: bool
    sha256: str
    size_bytes: int
    base_model: str | None
    rank: int | None
    alpha: float | None
    target_modules: list[str] | None
    dtype: str | None
    created_at: str | None
    validated_at: str | None


class Adapter(BaseModel):
    name: str
    current_version: int | None
    created_at: str | None
    versions: list[AdapterVersion]  # newest first


class ServedBaseModelDetail(BaseModel):
    name: str
    architecture: str | None
    num_layers: int | None
    modules: list[str]


class AdapterList(BaseModel):
    tenant: str
    served_base_models: list[str]
    served_base_model_details: list[ServedBaseModelDetail]
    data: list[Adapter]


class AdapterDeleted(BaseModel):
    name: str
    deleted: bool


# --- admin: SLOs (api/admin_slo.py) -----------------------------------------------------------

class AvailabilityObjective(BaseModel):
    target: float


class LatencyObjective(BaseModel):
    threshold_ms: int
    target: float


class SloObjectives(BaseModel):
    availability: AvailabilityObjective
    ttft: LatencyObjective
    tpot: LatencyObjective
    window_days: int


class SloValues(BaseModel):
    """Objective fields as set at one level (None: inherited from the level below)."""

    availability_target: float | None
    ttft_threshold_ms: int | None
    ttft_target: float | None
    tpot_threshold_ms: int | None
    tpot_target: float | None


class SloStatus(BaseModel):
    target: float
    threshold_ms: int | None
    requests_30d: int | None  # null when the source is Prometheus
    bad_30d: int | None
    error_ratio_30d: float | None  # null: no request in 30 days
    error_budget_remaining: float | None  # 1 untouched, 0 spent, < 0 overspent
    burn_rates: dict[str, float | None]  # window -> rate; null when the window holds no request


class SloStatuses(BaseModel):
    availability: SloStatus
    ttft: SloStatus
    tpot: SloStatus


class SloAlert(BaseModel):
    alert: str
    slo: str
    severity: str  # page | ticket
    long_window: str
    short_window: str
    burn_rate_threshold: float
    state: str  # firing | pending


class SloDocument(BaseModel):
    tenant: str
    plan: str
    objectives: SloObjectives
    overrides: SloValues
    source: Literal["prometheus", "usage_events"]
    status: SloStatuses
    alerts: list[SloAlert]
    source_error: str | None = None  # only when a configured Prometheus could not be read


class SloList(BaseModel):
    source: Literal["prometheus", "usage_events"]
    tenants: list[SloDocument]


class PlanSlo(BaseModel):
    plan: str
    objectives: SloObjectives
    values: SloValues


# --- admin: billing (api/admin_billing.py) ----------------------------------------------------

class Price(BaseModel):
    id: int
    tenant: str | None  # null: the book's price
    base_model: str
    priority: str
    token_kind: str
    micros_per_mtok: int
    effective_from: str
    created_at: str


class PriceBook(BaseModel):
    currency: str
    base_models: list[str]
    data: list[Price]


class HeldUsageList(BaseModel):
    data: list[HeldUsage]


class RollupReport(BaseModel):
    run_id: int
    events: int
    cutoff: str
    held: list[HeldUsage]


class Invoice(BaseModel):
    id: int
    tenant: str
    period: str
    status: Literal["closed"]
    period_start: str
    period_end: str
    currency: str
    line_items: int
    requests: int
    input_tokens: int
    cached_input_tokens: int
    output_tokens: int
    subtotal_micros: int
    allowance_tokens: int
    allowance_used_tokens: int
    allowance_credit_micros: int
    total_micros: int
    total: str | None
    held: list[Any]
    closed_at: str


class PendingTotals(BaseModel):
    requests: int
    input_tokens: int
    cached_input_tokens: int
    output_tokens: int
    held_tokens: int
    amount_micros: int


class BillingPeriodSummary(BaseModel):
    period: str
    status: Literal["open", "closed"]
    invoice: Invoice | None
    pending: PendingTotals | None


class BillingPeriodList(BaseModel):
    tenant: str
    currency: str
    data: list[BillingPeriodSummary]


class LineItem(BaseModel):
    usage_day: str
    base_model: str
    adapter: str | None
    priority: str
    requests: int
    input_tokens: int
    cached_input_tokens: int
    output_tokens: int
    input_price_micros_per_mtok: int | None
    cached_input_price_micros_per_mtok: int | None
    output_price_micros_per_mtok: int | None
    amount_picos: int | None
    amount: str | None
    amount_micros: int | None
    status: Literal["invoiced", "held", "pending"]


class BillingPeriod(BaseModel):
    tenant: str
    period: str
    status: Literal["open", "closed"]
    currency: str
    invoice: Invoice | None
    line_items: list[LineItem]
    message: str | None


class BillingExport(BaseModel):
    id: int
    tenant: str
    period: str
    format: str
    rows: int
    size_bytes: int
    sha256: str
    final: bool
    created_at: str
    filename: str
    download_url: str


class BillingExportQueued(BaseModel):
    status: Literal["queued"]
    task_id: str
    tenant: str
    period: str
    format: str


class BillingExportList(BaseModel):
    tenant: str
    data: list[BillingExport]


