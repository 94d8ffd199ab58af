"""One Alembic history: upgrade, downgrade, upgrade again on Postgres and SQLite; the models and
the migrations agree; the alembic CLI reads its URL from the app's settings."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from adapter_registry.migrate import downgrade, upgrade
from adapter_registry.settings import RegistrySettings
from tessera_core.db import Base, make_engine

REPO = Path(__file__).resolve().parents[2]
TABLES = {"tenants", "adapters", "adapter_versions", "blobs"}


@pytest.fixture(params=["sqlite", "postgres"])
def fresh_url(request, tmp_path, pg_database_factory):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'm.db'}"
    return pg_database_factory()


def _diff(url):
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return compare_metadata(MigrationContext.configure(conn), Base.metadata)
    finally:
        engine.dispose()


def _tables(url):
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade_and_models_agree(fresh_url):
    settings = RegistrySettings(database_url=fresh_url)
    upgrade(settings)
    assert TABLES <= _tables(fresh_url)
    assert _diff(fresh_url) == []
    downgrade(settings)
    assert _tables(fresh_url) == set()
    upgrade(settings)
    assert _diff(fresh_url) == []


def test_alembic_cli_reads_the_url_from_settings(tmp_path):
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    env = {**os.environ, "TESSERA_DATABASE_URL": url}
    r = subprocess.run([sys.executable, "-m", "alembic", "upgrade", "head"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert TABLES <= _tables(url)
