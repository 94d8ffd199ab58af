"""Fixtures for the adapter_registry tests: a real Postgres database per test run, SQLite files,
a real S3-protocol server (moto's standalone server) on loopback, and registry contexts over
both (sqlite + local directory, postgres + S3)."""
from __future__ import annotations

import uuid
from pathlib import Path

import psycopg2
import pytest
from sqlalchemy import text

from adapter_registry.migrate import upgrade
from adapter_registry.models import Adapter, AdapterVersion, Blob, Tenant
from adapter_registry.settings import RegistrySettings
from tessera_core.context import Context, build_context
from tessera_core.objectstore import S3Store
from tests.engine.lora_fixtures import SMOLLM2
from tests.requirements import require_postgres

PG_ADMIN = dict(host="127.0.0.1", port=5432, user="postgres", dbname="postgres")


def _pg_connect():
    require_postgres()
    return psycopg2.connect(connect_timeout=3, **PG_ADMIN)


def create_pg_database() -> str:
    """Create a uniquely named empty database; return its SQLAlchemy URL."""
    name = f"tessera_test_{uuid.uuid4().hex[:12]}"
    conn = _pg_connect()
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f'CREATE DATABASE "{name}"')
    conn.close()
    return f"postgresql+psycopg2://postgres@127.0.0.1:5432/{name}"


def drop_pg_database(url: str) -> None:
    name = url.rsplit("/", 1)[1]
    assert name.startswith("tessera_test_")  # never drop anything this run did not create
    conn = _pg_connect()
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    conn.close()


@pytest.fixture(scope="session")
def pg_database_factory():
    """Create Postgres databases on demand; all are dropped at the end of the run."""
    made: list[str] = []

    def make() -> str:
        made.append(create_pg_database())
        return made[-1]

    yield make
    for url in made:
        drop_pg_database(url)


@pytest.fixture(scope="session")
def pg_url(pg_database_factory):
    """One migrated Postgres database shared by the run (tables emptied after each test)."""
    url = pg_database_factory()
    upgrade(RegistrySettings(database_url=url))
    return url


S3_CREDS = dict(s3_access_key_id="testing", s3_secret_access_key="testing", s3_region="us-east-1")


def s3_settings(endpoint: str, **kw) -> dict:
    return dict(object_store="s3", s3_endpoint_url=endpoint, s3_bucket=f"tessera-{uuid.uuid4().hex[:10]}",
                s3_multipart_threshold_bytes=5 * 1024 * 1024, s3_multipart_chunk_bytes=5 * 1024 * 1024,
                **S3_CREDS, **kw)


def _empty_tables(ctx: Context) -> None:
    with ctx.engine.begin() as conn:
        if ctx.engine.dialect.name == "postgresql":
            conn.execute(text("TRUNCATE adapter_versions, adapters, blobs, tenants RESTART IDENTITY CASCADE"))
        else:
            conn.execute(text("UPDATE adapters SET current_version_id = NULL"))
            for model in (AdapterVersion, Adapter, Blob, Tenant):
                conn.execute(model.__table__.delete())


@pytest.fixture
def make_ctx(request, tmp_path, pg_url, s3_endpoint):
    """Build a Context: make_ctx("sqlite"|"postgres", **settings overrides; the served base
    model is the embedded SmolLM2's description unless served_base_models is given). SQLite uses
    a fresh migrated file; Postgres the run's database; "postgres" gets S3 unless object_store
    is given. Tables are emptied and engines disposed after the test."""
    made: list[Context] = []

    def make(backend: str = "sqlite", create_bucket: bool = True, **overrides) -> Context:
        # The registry validates against what the engine serves: the embedded SmolLM2 unless given.
        base = dict(object_store_root=tmp_path / "objects", adapter_cache_dir=tmp_path / "cache",
                    served_base_models=[SMOLLM2])
        if backend == "postgres":
            base.update(database_url=pg_url)
            if overrides.get("object_store", "s3") == "s3":
                base.update(s3_settings(s3_endpoint))
        else:
            base.update(database_url=f"sqlite:///{tmp_path / f'registry-{len(made)}.db'}")
        settings = RegistrySettings(**{**base, **overrides})
        if backend != "postgres":
            upgrade(settings)
        ctx = build_context(settings)
        if isinstance(ctx.store, S3Store) and create_bucket:
            ctx.store.ensure_bucket()
        made.append(ctx)
        return ctx

    yield make
    for ctx in made:
        if ctx.engine.dialect.name == "postgresql":
            _empty_tables(ctx)
        ctx.engine.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def ctx(request, make_ctx) -> Context:
    """A registry on each backend pair: sqlite + local directory, postgres + S3 (loopback)."""
    return make_ctx(request.param)


@pytest.fixture
def session(ctx):
    with ctx.session_factory() as s:
        yield s


@pytest.fixture
def adapter_dir(tmp_path) -> Path:
    from registry_helpers import write_adapter

    return write_adapter(tmp_path / "adapter")
