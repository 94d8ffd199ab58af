"""Platform settings: the registry's settings plus the gateway's, read once from TESSERA_* env vars
(or a .env file) or built explicitly (tests, the demo command).

The embedded defaults (SQLite under ./var, local object store, eager Celery, in-memory quota
counters, the engine in this process) need nothing configured. Scale-out sets
TESSERA_DATABASE_URL (Postgres), TESSERA_OBJECT_STORE=s3, TESSERA_REDIS_URL (quota counters),
TESSERA_ENGINE_MODE=http with TESSERA_ENGINE_URLS and TESSERA_ENGINE_SECRET. TESSERA_MODEL_PATH and
TESSERA_MODEL_NAME say which base model the deployment serves (tessera.served_model): every engine
worker and gateway of one deployment is given the same two.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from adapter_registry.settings import RegistrySettings


class PlatformSettings(RegistrySettings):
    """Everything `tessera serve` needs. Every field can be set as TESSERA_<FIELD>."""

    model_config = SettingsConfigDict(env_prefix="TESSERA_", env_file=".env", extra="ignore")

    host: str = Field("127.0.0.1", description="Address the gateway listens on.")
    port: int = Field(8000, ge=0, le=65535, description="Port the gateway listens on (0 picks a free one).")
    admin_token: SecretStr | None = Field(None, description="Bearer token of the admin API; unset disables it.")
    admin_password: SecretStr | None = Field(
        None, description="Sign-in password of the admin web UI (/admin); unset: the admin token is the password.")
    admin_session_ttl_s: int = Field(8 * 3600, ge=60, description="How long an admin web UI session lasts, in seconds.")
    admin_login_delay_s: float = Field(
        1.0, ge=0, description="Fixed delay before answering a wrong admin password or admin token.")
    admin_max_failures_per_minute: int = Field(
        10, ge=1, description="Wrong admin passwords/tokens from one client address within a minute before that "
                              "address is answered 429 (Retry-After) without checking, until the oldest slides out.")
    redis_url: str | None = Field(None, description="Redis for quota counters; unset keeps them in this process (embedded).")
    redis_key_prefix: str = Field("tessera:quota:", description="Prefix of every quota key in Redis.")

    engine_mode: Literal["inprocess", "http"] = Field("inprocess", description="Engine in this process, or engine workers over HTTP.")
    engine_urls: list[str] = Field(default_factory=list, description="Engine worker base URLs (engine_mode=http).")
    engine_secret: SecretStr | None = Field(None, description="Shared secret of the engine workers' internal API.")
    engine_connect_timeout_s: float = Field(2.0, gt=0, description="Connect timeout to an engine worker.")
    engine_read_timeout_s: float = Field(120.0, gt=0, description="Longest silence from an engine worker mid-request.")
    engine_state_poll_s: float = Field(0.5, gt=0, description="How often the gateway polls each engine worker's routing state (load, adapters per tier, draining).")
    engine_route_balance: float = Field(1.25, ge=1.0, description="Load bound of adapter-affinity routing: no engine worker takes a request that puts it above this times the mean load.")
    engine_drain_timeout_s: float = Field(25.0, ge=0, description="Longest an engine worker drains on SIGTERM (finishing the requests in flight, admitting none) before it exits anyway.")
    model_path: Path | None = Field(None, description="The base model every engine of this deployment serves: a .gguf "
                                    "file or a Hugging Face checkpoint directory (config.json + *.safetensors); unset "
                                    "takes the embedded SmolLM2. The gateway (HTTP engine mode) and the CLI read its "
                                    "config or header (tokenizer, name, shape), never its weights.")
    model_name: str | None = Field(None, min_length=1, max_length=200,
                                   description="The name the base model is served under (GET /v1/models, the model "
                                   "field, adapters' base model, billing); unset: the checkpoint's own (config.json's "
                                   "hub id, else the directory's or GGUF file's name). Adapters naming it, its final "
                                   "segment or an alias are accepted.")
    engine_threads: int | None = Field(None, ge=1, description="Torch threads of an in-process engine.")
    engine_kv_cache_mib: int | None = Field(None, ge=16, description="KV cache of an engine, in MiB (default: 256 on the CPU, a share of free memory on CUDA).")
    engine_max_loras: int | None = Field(None, ge=1, le=256, description="Distinct adapters one engine step runs at once (its device slots); unset: as many as engine_max_num_seqs on CUDA, 8 on the CPU. Each slot takes device memory for a max_rank-wide adapter.")
    engine_max_num_seqs: int | None = Field(None, ge=1, le=4096, description="Most requests one engine runs at once; unset: the engine's 64.")
    engine_lora_cpu_cache_mib: int | None = Field(None, ge=16, description="Host memory for loaded adapters per engine (the CPU tier, LRU), in MiB; a request whose adapter is not there waits for a fetch and load. Unset: the engine's 1024. Size it to the adapters a replica serves.")
    engine_prefix_caching: bool = Field(True, description="Reuse the KV of a tenant's repeated prompt prefixes "
                                        "(per tenant and adapter version). A hit computes the same tokens in "
                                        "fewer steps, equal in exact arithmetic but not bit for bit; off for "
                                        "bitwise-reproducible greedy output.")
    engine_big_request_kv_fraction: float = Field(
        0.5, gt=0, le=1, description="A request whose prompt + max_tokens needs more than this share of an engine's "
        "KV cache waits behind other tenants' requests of its priority class and is preempted for them, never "
        "the reverse (engine.scheduler's fairness rule).")
    engine_device: str = Field("cpu", pattern=r"^(cpu|cuda(:[0-9]+)?)$", description="Where an engine runs: cpu, cuda or cuda:N.")
    engine_backend: Literal["cpu", "triton"] | None = Field(None, description="The engine's kernels (default: cpu on the CPU, triton on CUDA).")

    max_body_bytes: int = Field(1 << 20, ge=1024, description="Largest request body accepted (413 beyond).")
    max_upload_bytes: int = Field(512 << 20, ge=1024, description="Largest adapter upload (multipart) body at the admin API.")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request gives none (capped by the context).")
    default_plan: str = Field("default", description="Plan of tenants created without one.")
    responses_retention_days: int = Field(30, ge=1, le=36500, description="How long a stored /v1/responses answer "
                                          "(store true, the default) is kept: older ones are the same 404 as an "
                                          "unknown id and are deleted (tessera.responses_store).")

    # Usage outbox (tessera/outbox.py): where usage events wait while the database cannot take them.
    usage_outbox_dir: Path = Field(Path("./var/usage-outbox"), description="Directory of the gateway processes' usage outbox files (one per process; local disk, kept across restarts).")
    usage_outbox_retry_max_s: float = Field(30.0, gt=0, description="Longest wait between two attempts to move outbox events into the database while it fails.")

    # HTTP connections (tessera/http_server.py): what one client may hold of every server command's
    # listener (serve, demo, engine-worker). Limits are per process.
    http_header_timeout_s: float = Field(10.0, gt=0, description="A request's line and headers must have arrived this many seconds after the connection opened or the request's first byte (else 408 and the connection is closed).")
    http_body_timeout_s: float = Field(30.0, gt=0, description="Grace for a request body: after this many seconds from its headers the body must have arrived at http_body_min_bytes_per_s on average, else the connection is closed.")
    http_body_min_bytes_per_s: int = Field(65536, ge=1, description="Slowest average rate a request body may arrive at once its grace (http_body_timeout_s) is over.")
    http_keep_alive_s: float = Field(5.0, gt=0, description="An idle keep-alive connection is closed after this many seconds.")
    http_max_header_bytes: int = Field(65536, ge=4096, le=1 << 20, description="Largest request line plus headers (431 beyond).")
    http_max_connections: int = Field(2048, ge=1, description="Open connections one server process holds; beyond it a new connection is answered 503 and closed.")
    http_max_connections_per_address: int = Field(256, ge=0, description="Open connections from one client address per gateway process (503 beyond); 0: no bound (behind a proxy that is the only client address, bound at the proxy instead). Engine workers, whose clients are the gateways, apply http_max_connections only.")

    # Observability (tessera.observability): /metrics, label bounds, where SLO status comes from.
    metrics_token: SecretStr | None = Field(None, description="Bearer token /metrics requires wherever it is served. Unset: open on the metrics port, and on the tenant port only for an embedded gateway (SQLite, engine in process) listening on loopback (tessera.observability.exposure).")
    metrics_port: int | None = Field(None, ge=1, le=65535, description="Serve /metrics on this port of TESSERA_HOST (one listener per `tessera serve`, every worker's values) and not on the tenant port; for Prometheus on a network tenants do not reach.")
    metrics_max_tenant_labels: int = Field(2000, ge=1, description="Distinct tenant label values per process; later tenants are counted as '_other'.")
    metrics_adapter_labels: bool = Field(False, description="Also export per-adapter request counts and latency (tenant, adapter name).")
    metrics_max_adapter_labels: int = Field(50, ge=1, description="Distinct (tenant, adapter) label pairs per process; the rest are '_other'.")
    prometheus_url: str | None = Field(None, description="Prometheus HTTP API the SLO status reads burn rates and alerts from; unset computes them from usage events.")
    tracing: bool = Field(False, description="OpenTelemetry traces of every completion request (gateway -> engine worker: auth, quota, model resolution, routing, queue, prefill, decode), `traceparent` continued from callers and returned; exported by OTLP/HTTP as the standard OTEL_* variables say (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_TRACES_SAMPLER[_ARG], OTEL_SERVICE_NAME). Off: no span, no header (tessera.observability.tracing).")
    otel_tracing: bool = Field(False, description="FastAPI's OpenTelemetry spans and HTTP metrics, exported through the providers configured by OTEL_* settings; off by default (its per-request checks cost ~5% of the gateway's own time, and Prometheus already has the request metrics).")

    # Billing (tessera.billing): prices in integer micro-units of this currency.
    billing_currency: str = Field("USD", pattern=r"^[A-Z]{3}$", description="ISO 4217 code of every price and invoice.")
    billing_queue: str = Field("billing", description="Celery queue of the billing tasks (rollup, close, export).")
    billing_rollup_interval_s: float = Field(300.0, ge=1, description="How often usage is rolled up into line items (beat, or the embedded loop).")
    billing_close_grace_s: float = Field(3600.0, ge=0, description="How long after a month ends its invoices are closed (events still in flight land first).")

    @model_validator(mode="after")
    def _http_mode_needs_workers(self) -> "PlatformSettings":
        if self.engine_mode == "http" and (not self.engine_urls or self.engine_secret is None):
            raise ValueError("engine_mode=http needs engine_urls and engine_secret")
        return self


@lru_cache(maxsize=1)
def get_settings() -> PlatformSettings:
    """Process-wide settings from the environment (a FastAPI dependency; tests build their own)."""
    return PlatformSettings()
