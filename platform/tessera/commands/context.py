"""The platform context a CLI command works on: settings from TESSERA_* (and .env), the embedded
SQLite database created/migrated on first use, Postgres expected migrated already."""
from __future__ import annotations


def platform_context(required_table: str):
    """A Context over PlatformSettings; CLIError (one line) when the database is
    unreachable or lacks `required_table`."""
    from sqlalchemy import inspect
    from sqlalchemy.exc import SQLAlchemyError

    from adapter_registry.migrate import upgrade
    from tessera.cli import CLIError
    from tessera.commands.serve import load_settings
    from tessera_core.context import build_context

    settings = load_settings()
    try:
        if settings.database_url.startswith("sqlite"):
            upgrade(settings)  # embedded mode: create/migrate the local database
        ctx = build_context(settings)
        if required_table not in inspect(ctx.engine).get_table_names():
            raise CLIError(f"database {ctx.engine.url!r} has no {required_table} table; run `alembic upgrade head` first")
    except SQLAlchemyError as e:
        raise CLIError(f"database unavailable: {type(e).__name__}: {e.__cause__ or e}") from None
    return ctx
