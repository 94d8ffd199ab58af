"""The registry's runtime objects built from settings: database engine, sessions, object store.

Built once per process on first use (a Celery worker, the CLI); the platform builds its own from
composed settings. Tests build one per database with `build_context`.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from sqlalchemy.engine import Engine
from sqlalchemy.orm import sessionmaker

from adapter_registry.db import make_engine, make_session_factory
from adapter_registry.objectstore import ObjectStore, make_object_store
from adapter_registry.settings import RegistrySettings, get_settings


@dataclass
class RegistryContext:
    settings: RegistrySettings
    engine: Engine
    session_factory: sessionmaker
    store: ObjectStore


def build_context(settings: RegistrySettings) -> RegistryContext:
    """A RegistryContext for `settings` (connects lazily; nothing is created)."""
    engine = make_engine(settings.database_url)
    return RegistryContext(settings, engine, make_session_factory(engine), make_object_store(settings))


@lru_cache(maxsize=1)
def get_context() -> RegistryContext:
    """The process-wide context from get_settings()."""
    return build_context(get_settings())
