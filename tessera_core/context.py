"""The runtime objects built from settings: database engine, sessions, object store.

The registry's Celery worker builds one per process (adapter_registry.tasks), the platform one
from its composed settings (the gateway, billing's worker, the CLI). Tests build one per database
with `build_context`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from sqlalchemy.engine import Engine
from sqlalchemy.orm import sessionmaker

from tessera_core.db import make_engine, make_session_factory
from tessera_core.objectstore import ObjectStore, make_object_store
from tessera_core.settings import CoreSettings

S = TypeVar("S", bound=CoreSettings)


@dataclass
class Context(Generic[S]):
    """What a process works with: the settings it was built from (RegistrySettings,
    PlatformSettings: callers read their own fields from it), the database engine, its session
    factory and the object store."""

    settings: S
    engine: Engine
    session_factory: sessionmaker
    store: ObjectStore


def build_context(settings: S) -> Context[S]:
    """A Context for `settings` (connects lazily; nothing is created)."""
    engine = make_engine(settings.database_url)
    return Context(settings, engine, make_session_factory(engine), make_object_store(settings))
