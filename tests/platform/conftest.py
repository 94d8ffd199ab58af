"""Fixtures for the gateway tests: one engine per run (the embedded SmolLM2), one migrated SQLite
database, and the real app served by uvicorn on a loopback port in a thread. Each test makes its
own tenants (unique names), so tests never share quota counters or usage."""
from __future__ import annotations

import socket
import threading
import time
import uuid
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from adapter_registry.engine_source import RegistryAdapterSource
from adapter_registry.migrate import upgrade
from engine.async_engine import AsyncLLMEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tessera.app import create_app
from tessera.engine_client.inprocess import InProcessEngineClient
from tessera.settings import PlatformSettings
from tessera_core.context import build_context

ADMIN_TOKEN = "test-admin-token-" + "x" * 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving `app` on a free loopback port, in a daemon thread."""

    def __init__(self, app):
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Tenant:
    name: str
    key: str
    key_id: int


class Platform:
    """A running gateway plus admin helpers."""

    def __init__(self, url: str, settings: PlatformSettings, app):
        self.url = url
        self.settings = settings
        self.app = app
        self.admin = httpx.Client(base_url=url, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=60)

    @property
    def gateway(self):
        return self.app.state.gateway

    def tenant(self, **limits) -> Tenant:
        """A new tenant on its own plan with `limits` (PlanIn fields), and one key."""
        name = "t-" + uuid.uuid4().hex[:10]
        r = self.admin.put(f"/admin/v1/plans/{name}", json=limits)
        assert r.status_code == 200, r.text
        r = self.admin.post("/admin/v1/tenants", json={"name": name, "plan": name})
        assert r.status_code == 201, r.text
        r = self.admin.post(f"/admin/v1/tenants/{name}/keys", json={"name": "test"})
        assert r.status_code == 201, r.text
        return Tenant(name, r.json()["key"], r.json()["id"])

    def openai(self, tenant: Tenant, **kw):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=tenant.key, max_retries=0, timeout=120, **kw)

    def async_openai(self, tenant: Tenant, **kw):
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=tenant.key, max_retries=0, timeout=120, **kw)

    def usage_events(self, tenant_name: str) -> list:
        from sqlalchemy import select

        from adapter_registry.models import Tenant as TenantRow
        from tessera.models import UsageEvent

        with self.gateway.session_factory() as s:
            tid = s.scalar(select(TenantRow.id).where(TenantRow.name == tenant_name))
            return list(s.scalars(select(UsageEvent).where(UsageEvent.tenant_id == tid)))


@pytest.fixture(scope="session")
def platform_settings(tmp_path_factory) -> PlatformSettings:
    root = tmp_path_factory.mktemp("gateway")
    settings = PlatformSettings(
        _env_file=None, database_url=f"sqlite:///{root}/tessera.db", object_store_root=root / "objects",
        adapter_cache_dir=root / "adapter-cache", usage_outbox_dir=root / "usage-outbox", admin_token=ADMIN_TOKEN,
        # Wrong admin credentials are answered after this delay; tests that send them on purpose
        # need not wait the production second each time.
        admin_login_delay_s=0.05, max_body_bytes=64 * 1024)
    upgrade(settings)
    return settings


@pytest.fixture(scope="session")
def aengine(platform_settings):
    """The one engine of the run, with the test database as its adapter source."""
    ctx = build_context(platform_settings)
    source = RegistryAdapterSource(session_factory=ctx.session_factory, store=ctx.store,
                                   cache_dir=platform_settings.adapter_cache_dir)
    engine = LLMEngine(config=EngineConfig(kv_cache_bytes=64 << 20, max_num_seqs=32), adapter_source=source)
    a = AsyncLLMEngine(engine)
    yield a
    a.shutdown()


@pytest.fixture(scope="session")
def platform(platform_settings, aengine):
    app = create_app(platform_settings, engine_client=InProcessEngineClient(aengine))
    with ServerThread(app) as server:
        yield Platform(server.url, platform_settings, app)


def wait_engine_idle(aengine, timeout: float = 60.0) -> None:
    """Block until the engine holds no request (aborts are processed on its thread)."""
    deadline = time.monotonic() + timeout
    while aengine.engine.has_unfinished() or aengine.engine.requests:
        if time.monotonic() > deadline:
            raise AssertionError(f"engine still holds {list(aengine.engine.requests)}")
        time.sleep(0.05)


@pytest.fixture(scope="session")
def shared_demo(tmp_path_factory):
    """One `tessera demo` subprocess (tests/platform/demo_process.py) for the modules that only
    send it requests (the tool clients, the tools adapter, guidellm, the Responses API): each
    uses its own tenant or only reads, so they share one model load and adapter upload. The
    newcomer test runs its own (it ends it with Ctrl+C)."""
    from .demo_process import Demo

    d = Demo(tmp_path_factory.mktemp("shared-demo"))
    d.wait_ready()
    yield d
    d.stop()
    assert "Traceback" not in d.stderr_text(), d.stderr_text()
