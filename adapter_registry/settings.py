"""Registry settings, read once from the environment (prefix TESSERA_) or built explicitly.

They extend tessera_core.settings.CoreSettings (database, object store, broker). The same class
configures the embedded default (SQLite under ./var, a local-directory object store, validation
run inline) and scale-out (Postgres, any S3-compatible endpoint, a Celery worker behind Redis).
The platform composes these settings with its own; Alembic reads the database URL from here too.
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from adapter_registry.base_models import aliases_in_effect, check_alias_names
from engine.lora.peft_format import BaseModelShape
from tessera_core.settings import CoreSettings, MiB

# safetensors dtype names the engine can load adapters in.
SUPPORTED_DTYPES = ("F16", "BF16", "F32")


class RegistrySettings(CoreSettings):
    """Adapter registry configuration, over the shared database, object store and broker
    settings. Every field can be set as TESSERA_<FIELD> in the environment."""

    model_config = SettingsConfigDict(env_prefix="TESSERA_", extra="ignore")

    adapter_cache_dir: Path = Field(Path("./var/adapter-cache"), description="Engine-side disk cache of fetched versions, by sha256.")

    served_base_models: list[BaseModelShape] = Field(
        default_factory=list,
        description="The base models the platform serves, as their engine describes them "
        "(engine.lora.peft_format.BaseModelShape: name, architecture, layers, LoRA-able modules and their "
        "shapes); adapters for any other base, or that do not fit it, are refused. Not configured by hand: "
        "the gateway and `tessera demo` take it from their engine, the CLI from the model files "
        "TESSERA_MODEL_PATH names (`serving`). Empty until an engine has described its model; uploads "
        "are refused (503) meanwhile.",
    )
    base_model_aliases: dict[str, str] = Field(
        default_factory=dict,
        description="Alias or local path -> served base model, for adapters whose base_model_name_or_path "
        "names the base some other way (JSON in TESSERA_BASE_MODEL_ALIASES). Every target must be served "
        "(checked once the served models are known); `aliases` adds each served model's built-in ones.",
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

    celery_eager: bool = Field(True, description="Run validation inline (embedded mode) instead of on a worker.")
    celery_queue: str = Field("adapter-registry", description="Queue the validation task is sent to.")

    @field_validator("allowed_dtypes")
    @classmethod
    def _known_dtypes(cls, v: list[str]) -> list[str]:
        return _only_known(v, SUPPORTED_DTYPES, "unsupported dtypes {}; choose among " + str(list(SUPPORTED_DTYPES)))

    @field_validator("served_base_models", mode="before")
    @classmethod
    def _descriptions(cls, v: Any) -> Any:
        # JSON (an environment variable, a worker's answer) -> descriptions, with their own checks.
        if isinstance(v, (list, tuple)):
            return [BaseModelShape.from_dict(m) if isinstance(m, dict) else m for m in v]
        return v

    @model_validator(mode="after")
    def _aliases_name_served_models(self) -> "RegistrySettings":
        check_alias_names(self.base_model_aliases)
        if self.served_base_models:
            aliases_in_effect(self.base_model_aliases, self.served_names)
        return self

    @property
    def served_names(self) -> list[str]:
        """The served base models' names."""
        return [m.name for m in self.served_base_models]

    @property
    def aliases(self) -> dict[str, str]:
        """The aliases names resolve with: each served model's built-in ones, then the configured
        base_model_aliases (adapter_registry.base_models.aliases_in_effect)."""
        return aliases_in_effect(self.base_model_aliases, self.served_names)

    def served_model(self, name: str) -> BaseModelShape:
        """The description of served model `name` (KeyError if it is not served)."""
        for m in self.served_base_models:
            if m.name == name:
                return m
        raise KeyError(name)

    def serving(self, models: Sequence[BaseModelShape]):
        """These settings (same class) with `models` as the served base models, as an engine
        described them. ValueError naming TESSERA_BASE_MODEL_ALIASES when a configured alias
        names none of them."""
        models = list(models)
        aliases_in_effect(self.base_model_aliases, [m.name for m in models])
        return self.model_copy(update={"served_base_models": models})


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
