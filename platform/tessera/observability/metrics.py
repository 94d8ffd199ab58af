"""The gateway's Prometheus metrics, observed once per request where usage is recorded.

Every request that reaches the engine ends in `Meter.record` (tessera/metering.py) with its
tenant, priority class, status, TTFT, duration and token counts; `GatewayMetrics.observe` turns
that one record into these series (no per-token work, nothing on the streaming path):

  tessera_requests_total{tenant, priority, status}        status: completed | aborted | error
  tessera_request_ttft_seconds{tenant, priority}          histogram, requests that got a first token
  tessera_request_tpot_seconds{tenant, priority}          histogram, (duration - ttft) / (completion - 1)
  tessera_request_duration_seconds{tenant, priority}      histogram, end to end
  tessera_prompt_tokens_total{tenant}, tessera_completion_tokens_total{tenant}
  tessera_cached_prompt_tokens_total{tenant}              of the prompt tokens, those the engine's
                                                          prefix cache served
  tessera_quota_refusals_total{tenant, reason}            reason: requests | tokens | concurrency | budget
  tessera_usage_events_deferred_total, tessera_usage_outbox_depth   usage events the database could
                                                          not take at once / still waiting (metering.py)
  tessera_adapter_requests_total{tenant, adapter, status} only with metrics_adapter_labels
  tessera_adapter_request_ttft_seconds{tenant, adapter}   only with metrics_adapter_labels
  tessera_adapter_request_duration_seconds{tenant, adapter} only with metrics_adapter_labels

Label cardinality is bounded: `tenant` is the tenant's name for the first
`metrics_max_tenant_labels` tenants this process sees, then "_other"; `adapter` (the adapter name,
never its version) exists only behind `metrics_adapter_labels`, for at most
`metrics_max_adapter_labels` (tenant, adapter) pairs, then "_other". Request ids and keys are
never labels.

Multiprocess: with PROMETHEUS_MULTIPROC_DIR set before this module is imported (`tessera serve
--workers N` sets it), prometheus-client keeps the values in per-process files and `render`
aggregates every worker's values, so any worker's /metrics answers for all of them.
"""
from __future__ import annotations

import functools
import logging
import os
import threading

import anyio
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from sqlalchemy import select

from tessera_core.db import read_only_session

log = logging.getLogger(__name__)

# Bucket bounds (seconds) sized for LLM serving: TTFT from tens of ms (short prompt, idle engine)
# to a minute (long prefill behind a queue); TPOT from 5 ms (GPU decode) to 1 s (overloaded
# CPU). An SLO threshold must be one of these bounds (slo_definitions.check_values), so the burn-rate rules read
# the threshold's bucket exactly instead of interpolating.
TTFT_BUCKETS_S = (0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 60.0)
TPOT_BUCKETS_S = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
DURATION_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)

OTHER = "_other"

REQUESTS = Counter("tessera_requests_total", "Requests that reached the engine, by final status.",
                   ["tenant", "priority", "status"])
TTFT = Histogram("tessera_request_ttft_seconds", "Time from request arrival to the first token.",
                 ["tenant", "priority"], buckets=TTFT_BUCKETS_S)
TPOT = Histogram("tessera_request_tpot_seconds", "Mean time per output token after the first.",
                 ["tenant", "priority"], buckets=TPOT_BUCKETS_S)
DURATION = Histogram("tessera_request_duration_seconds", "End-to-end request latency.",
                     ["tenant", "priority"], buckets=DURATION_BUCKETS_S)
PROMPT_TOKENS = Counter("tessera_prompt_tokens_total", "Prompt tokens billed.", ["tenant"])
COMPLETION_TOKENS = Counter("tessera_completion_tokens_total", "Completion tokens billed.", ["tenant"])
CACHED_PROMPT_TOKENS = Counter("tessera_cached_prompt_tokens_total",
                               "Prompt tokens served from the engine's prefix cache (of tessera_prompt_tokens_total).",
                               ["tenant"])
QUOTA_REFUSALS = Counter("tessera_quota_refusals_total", "Requests refused with 429 by a quota.",
                         ["tenant", "reason"])
ADAPTER_REQUESTS = Counter("tessera_adapter_requests_total", "Requests per adapter (metrics_adapter_labels).",
                           ["tenant", "adapter", "status"])
ADAPTER_TTFT = Histogram("tessera_adapter_request_ttft_seconds", "TTFT per adapter (metrics_adapter_labels).",
                         ["tenant", "adapter"], buckets=TTFT_BUCKETS_S)
ADAPTER_DURATION = Histogram("tessera_adapter_request_duration_seconds",
                             "End-to-end latency per adapter (metrics_adapter_labels).",
                             ["tenant", "adapter"], buckets=DURATION_BUCKETS_S)


@functools.lru_cache(maxsize=1)
def usage_outbox_metrics() -> tuple[Counter, Gauge]:
    """The usage outbox's series (tessera/metering.py): (events deferred, outbox depth). A
    label-free metric opens its multiprocess file when it is created, so these are made on first
    use (a gateway's meter), not at import: `tessera serve --workers` imports this module before
    it makes the multiprocess directory."""
    return (Counter("tessera_usage_events_deferred_total",
                    "Usage events the database could not take at once, kept in the outbox."),
            Gauge("tessera_usage_outbox_depth", "Usage events waiting in the outbox for the database.",
                  multiprocess_mode="livesum"))


def multiprocess_dir() -> str | None:
    """The prometheus-client multiprocess directory of this process, if multiprocess mode is on."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir")


def render() -> tuple[bytes, str]:
    """(body, content type) of /metrics: every worker's values in multiprocess mode, else this
    process's registry (which also holds an in-process engine's metrics)."""
    if multiprocess_dir():
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


class _BoundedLabels:
    """Maps keys to label values, the first `limit` keys as themselves, the rest to OTHER."""

    def __init__(self, limit: int):
        self.limit = limit
        self._seen: dict = {}
        self._lock = threading.Lock()

    def get(self, key, value: str) -> str:
        label = self._seen.get(key)
        if label is None:
            with self._lock:
                label = self._seen.get(key)
                if label is None:
                    label = value if len(self._seen) < self.limit else OTHER
                    self._seen[key] = label
        return label


class GatewayMetrics:
    """Observes finished requests and quota refusals (built once per app by the lifespan).

    Tenant ids are turned into tenant names once per tenant and process (one indexed query on a
    worker thread; names never change), so the request path only does a dict lookup.
    """

    def __init__(self, session_factory, *, max_tenant_labels: int = 2000, adapter_labels: bool = False,
                 max_adapter_labels: int = 50):
        self.session_factory = session_factory
        self.adapter_labels = adapter_labels
        self._names: dict[int, str] = {}
        self._tenants = _BoundedLabels(max_tenant_labels)
        self._adapters = _BoundedLabels(max_adapter_labels)

    def _lookup(self, tenant_id: int) -> str:
        from adapter_registry.models import Tenant

        with read_only_session(self.session_factory) as session:
            name = session.scalar(select(Tenant.name).where(Tenant.id == tenant_id))
        return name or str(tenant_id)

    async def tenant_label(self, tenant_id: int | str) -> str:
        """The `tenant` label of a tenant id (its name, or OTHER past the cap)."""
        tid = int(tenant_id)
        name = self._names.get(tid)
        if name is None:
            try:
                name = await anyio.to_thread.run_sync(self._lookup, tid)
            except Exception:  # noqa: BLE001 - a metric must never fail a request
                log.warning("metrics: could not look up the name of tenant %s", tid, exc_info=True)
                return str(tid)
            self._names[tid] = name
        return self._tenants.get(tid, name)

    async def observe(self, usage) -> None:
        """Count one finished request (a tessera.metering.Usage)."""
        tenant = await self.tenant_label(usage.tenant_id)
        prio = usage.priority
        REQUESTS.labels(tenant, prio, usage.status).inc()
        DURATION.labels(tenant, prio).observe(usage.duration_ms / 1000.0)
        if usage.prompt_tokens:
            PROMPT_TOKENS.labels(tenant).inc(usage.prompt_tokens)
        if usage.cached_tokens:
            CACHED_PROMPT_TOKENS.labels(tenant).inc(usage.cached_tokens)
        if usage.completion_tokens:
            COMPLETION_TOKENS.labels(tenant).inc(usage.completion_tokens)
        if usage.ttft_ms is not None:
            TTFT.labels(tenant, prio).observe(usage.ttft_ms / 1000.0)
            if usage.completion_tokens >= 2:
                TPOT.labels(tenant, prio).observe(
                    max(0.0, usage.duration_ms - usage.ttft_ms) / 1000.0 / (usage.completion_tokens - 1))
        if self.adapter_labels and usage.adapter_version is not None:
            name = usage.model.partition("@")[0]
            adapter = self._adapters.get((usage.tenant_id, name), name)
            ADAPTER_REQUESTS.labels(tenant, adapter, usage.status).inc()
            ADAPTER_DURATION.labels(tenant, adapter).observe(usage.duration_ms / 1000.0)
            if usage.ttft_ms is not None:
                ADAPTER_TTFT.labels(tenant, adapter).observe(usage.ttft_ms / 1000.0)

    async def refused(self, tenant_id: int | str, reason: str) -> None:
        """Count one request refused by a quota (429)."""
        QUOTA_REFUSALS.labels(await self.tenant_label(tenant_id), reason).inc()


class RefusalCountingQuota:
    """A QuotaBackend that counts refusals of the backend it wraps (the quota refusal path's hook:
    every refusal is a `reserve` answer that is not admitted, or a `peek` that finds one)."""

    def __init__(self, inner, metrics: GatewayMetrics):
        self.inner = inner
        self.metrics = metrics

    async def reserve(self, **kw):
        decision = await self.inner.reserve(**kw)
        if not decision.admitted:
            await self._count(kw["tenant"], decision.reason)
        return decision

    async def peek(self, **kw):
        refusal = await self.inner.peek(**kw)
        if refusal is not None:
            await self._count(kw["tenant"], refusal.reason)
        return refusal

    async def _count(self, tenant: str, reason: str) -> None:
        try:
            await self.metrics.refused(tenant, reason)
        except Exception:  # noqa: BLE001 - a metric must never fail a request
            log.warning("metrics: could not count a quota refusal", exc_info=True)

    def __getattr__(self, name):
        return getattr(self.inner, name)
