"""The settings every part shares, read from the environment (prefix TESSERA_) or built explicitly:
where the database is, where objects are stored (adapter files, billing exports) and which broker
Celery uses.

The registry's settings (adapter_registry.settings.RegistrySettings) extend this class and the
platform's (tessera.settings.PlatformSettings) extend the registry's, so one object configures a
process; the context (tessera_core.context) is built from any of them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

MiB = 1024 * 1024


class CoreSettings(BaseSettings):
    """Database, object store and broker. Every field can be set as TESSERA_<FIELD> in the environment."""

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

    celery_broker_url: str = Field("redis://127.0.0.1:6379/0", description="Celery broker of every Tessera worker (registry validation, billing).")

    @model_validator(mode="after")
    def _s3_credentials_pair(self) -> "CoreSettings":
        if (self.s3_access_key_id is None) != (self.s3_secret_access_key is None):
            raise ValueError("set both s3_access_key_id and s3_secret_access_key, or neither")
        return self
