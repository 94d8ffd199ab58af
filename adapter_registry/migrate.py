"""Run the Alembic history programmatically (embedded set-up, tests) with the app's settings."""
from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

from adapter_registry.settings import RegistrySettings

REPO_ROOT = Path(__file__).resolve().parent.parent


def alembic_config(settings: RegistrySettings) -> Config:
    """An Alembic Config for the repository's alembic.ini, pointed at `settings.database_url`."""
    cfg = Config(str(REPO_ROOT / "alembic.ini"))
    cfg.attributes["settings"] = settings
    cfg.attributes["skip_logging"] = True  # keep the caller's logging configuration
    return cfg


def upgrade(settings: RegistrySettings, revision: str = "head") -> None:
    """Migrate the database of `settings` up to `revision` (creating the SQLite file's folder)."""
    if settings.database_url.startswith("sqlite:///"):
        path = settings.database_url.removeprefix("sqlite:///")
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    command.upgrade(alembic_config(settings), revision)


def downgrade(settings: RegistrySettings, revision: str = "base") -> None:
    """Migrate the database of `settings` down to `revision`."""
    command.downgrade(alembic_config(settings), revision)
