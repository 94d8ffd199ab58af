"""Registry settings, read once from the environment (prefix TESSERA_) or built explicitly.

The same class configures the embedded default (SQLite under ./var, a local-directory object
store, validation run inline) and scale-out (Postgres, any S3-compatible endpoint, a Celery
worker behind Redis). The platform composes these settings with its own; Alembic reads the
database URL from here too.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from adapter_registry.base_models import aliases_in_effect
from engine.lora.peft_format import KNOWN_BASE_MODELS, SMOLLM2_135M_INSTRUCT

MiB = 1024 * 1024
# safetensors dtype names the engine can load adapters in.
SUPPORTED_DTYPES = ("F16", "BF16", "F32")


class RegistrySettings(BaseSettings):
    """Adapter registry configuration. Every field can be set as TESSERA_<FIELD> in the environment."""

    model_config = SettingsConfigDict(env_prefix="TESSERA_", extra="ignore")

    database_url: str = Field("sqlite:///./var/tessera.db", description="SQLAlchemy URL: sqlite:///... or postgresql+psycopg2://...")

    object_store: Literal["local", "s3"] = Field("local", description="Where adapter files live.")
    object_store_root: Path = Field(Path("./var/objects"), description="Root directory of the local object store.")
    s3_endpoint_url: str | None = Field(None, description="S3 endpoint (MinIO, moto, ...); None means AWS.")
    s3_bucket: str = Field("tessera-adapters", description="Bucket holding adapter objects.")
    s3_prefix: str = Field("", description="Key prefix inside the bucket, e.g. 'prod/'.")
    s3_region: str = Field("us-east-1", description="S3 region name.")
    s3_access_key_id: SecretStr | None = Field(None, description="Access key; None uses boto3's default chain.")
    s3_secret_access_key: SecretStr | None = Field(None, description="Secret key; None uses boto3's default chain.")
    s3_multipart_threshold_bytes: int = Field(8 * MiB, ge=5 * MiB, description="Files at least this large upload in parts.")
    s3_multipart_chunk_bytes: int = Field(8 * MiB, ge=5 * MiB, description="Part size of multipart uploads (S3 minimum 5 MiB).")

    adapter_cache_dir: Path = Field(Path("./var/adapter-cache"), description="Engine-side disk cache of fetched versions, by sha256.")

    served_base_models: list[str] = Field(
        default_factory=lambda: [SMOLLM2_135M_INSTRUCT.name],
        description="Base models the platform serves; adapters for any other base are rejected.",
    )
    base_model_aliases: dict[str, str] = Field(
        default_factory=dict,
        description="Alias or local path -> served base model, for adapters whose base_model_name_or_path "
        "names the base some other way (JSON in TESSERA_BASE_MODEL_ALIASES). Every target must be served; "
        "after validation it also holds the built-in aliases of each served model.",
    )
    max_rank: int = Field(64, ge=1, description="Highest LoRA rank accepted.")
    allowed_dtypes: list[str] = Field(default_factory=lambda: ["F16", "BF16", "F32"], description="safetensors dtypes accepted.")
    default_max_adapter_bytes: int = Field(256 * MiB, ge=1, description="Weights size limit for tenants without their own.")
    default_max_adapters: int = Field(100, ge=0, description="Adapter names per tenant, for tenants without their own limit.")
    archive_max_uncompressed_bytes: int = Field(1024 * MiB, ge=1, description="Total bytes an uploaded archive may expand to.")
    archive_max_files: int = Field(32, ge=2, description="Entries an uploaded archive may hold.")

    validation_timeout_s: float = Field(
        30.0, gt=0, description="Wall-clock deadline (and, rounded up plus 1 s, CPU limit) of one adapter's "
        "validation in its child process; past it the version is rejected with that reason.")
    validation_max_memory_bytes: int = Field(
        1024 * MiB, ge=64 * MiB, description="Address-space cap (RLIMIT_AS) of the validation child process; "
        "a file that needs more is rejected.")
    validation_max_concurrent: int = Field(
        2, ge=1, description="Validation child processes one process runs at once (each may use up to "
        "validation_max_memory_bytes); further uploads wait for a slot.")
    validation_activation_bound: float = Field(
        64.0, gt=0, description="Largest activation entry the overflow check plans for: an adapter is refused "
        "when some module's gain (|scale| x ||B||inf x ||A||inf) times this exceeds fp16's 65504.")

    celery_broker_url: str = Field("redis://127.0.0.1:6379/0", description="Celery broker for validation tasks.")
    celery_eager: bool = Field(True, description="Run validation inline (embedded mode) instead of on a worker.")
    celery_queue: str = Field("adapter-registry", description="Queue the validation task is sent to.")

    @field_validator("allowed_dtypes")
    @classmethod
    def _known_dtypes(cls, v: list[str]) -> list[str]:
        return _only_known(v, SUPPORTED_DTYPES, "unsupported dtypes {}; choose among " + str(list(SUPPORTED_DTYPES)))

    @field_validator("served_base_models")
    @classmethod
    def _known_bases(cls, v: list[str]) -> list[str]:
        return _only_known(v, KNOWN_BASE_MODELS, "unknown base models {}; known: " + str(sorted(KNOWN_BASE_MODELS)))

    @model_validator(mode="after")
    def _aliases_name_served_models(self) -> "RegistrySettings":
        self.base_model_aliases = aliases_in_effect(self.base_model_aliases, self.served_base_models)
        return self

    @model_validator(mode="after")
    def _s3_credentials_pair(self) -> "RegistrySettings":
        if (self.s3_access_key_id is None) != (self.s3_secret_access_key is None):
            raise ValueError("set both s3_access_key_id and s3_secret_access_key, or neither")
        return self


def _only_known(values: list[str], known, message: str) -> list[str]:
    """`values` unchanged when each is in `known`; else ValueError with `message` naming the
    unknown ones (sorted) in its `{}`."""
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(message.format(unknown))
    return values


@lru_cache(maxsize=1)
def get_settings() -> RegistrySettings:
    """The process-wide settings, read from the environment on first use (tests call cache_clear)."""
    return RegistrySettings()
