"""Alembic environment: one history for all Tessera tables, Postgres or SQLite.

The URL comes from the registry settings (TESSERA_DATABASE_URL), or from a RegistrySettings
passed programmatically as config.attributes["settings"] (adapter_registry.migrate does).
"""
from __future__ import annotations

import importlib
from logging.config import fileConfig

from alembic import context

from adapter_registry.settings import get_settings
from tessera_core.db import Base, make_engine

# Every module defining tables on Base.metadata: the registry's, the platform's, billing's, the SLOs'.
MODEL_MODULES = ["adapter_registry.models", "tessera.models", "tessera.billing.models", "tessera.observability.models"]
for _module in MODEL_MODULES:
    importlib.import_module(_module)

config = context.config
if config.config_file_name is not None and not config.attributes.get("skip_logging"):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def _url() -> str:
    settings = config.attributes.get("settings") or get_settings()
    return settings.database_url


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True,
                      render_as_batch=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = make_engine(_url())
    try:
        with engine.connect() as connection:
            # Batch mode: SQLite cannot ALTER constraints, so Alembic rebuilds the table there.
            context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
