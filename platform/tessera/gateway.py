"""The gateway's runtime objects, built once per app by the lifespan (see app.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request
from sqlalchemy.engine import Engine
from sqlalchemy.orm import sessionmaker

from adapter_registry.objectstore import ObjectStore
from tessera.engine_client import EngineClient
from tessera.epoch import Epoch, EpochCache
from tessera.metering import Meter
from tessera.quota import QuotaBackend
from tessera.settings import PlatformSettings


@dataclass
class Gateway:
    settings: PlatformSettings
    db: Engine
    session_factory: sessionmaker
    store: ObjectStore
    engine: EngineClient
    quota: QuotaBackend
    meter: Meter
    epoch: Epoch
    callers: EpochCache = field(default_factory=EpochCache)  # sha256(key) -> Caller
    #: (tenant id, month) pairs whose budget counter this process has seeded from usage_events.
    seeded_budgets: set = field(default_factory=set)


async def get_gateway(request: Request) -> Gateway:
    """The app's Gateway (a dependency). Async on purpose: FastAPI runs a plain `def` dependency
    on a worker thread, a thread hop on every request for an attribute read."""
    return request.app.state.gateway
