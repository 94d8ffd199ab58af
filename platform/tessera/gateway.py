"""The gateway's runtime objects, built once per app by the lifespan (see app.py)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from sqlalchemy.engine import Engine
from sqlalchemy.orm import sessionmaker

from tessera.engine_client import EngineClient
from tessera.epoch import Epoch, EpochCache
from tessera.metering import Meter
from tessera.quota import QuotaBackend
from tessera.settings import PlatformSettings
from tessera_core.objectstore import ObjectStore

log = logging.getLogger(__name__)


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
    #: (tenant id, model) -> the registry lookup of that adapter reference in flight, shared by the
    #: requests that name it meanwhile (api/model_resolution.py); an entry leaves when it ends.
    adapter_lookups: dict = field(default_factory=dict, repr=False)
    #: (tenant id, month) pairs whose budget counter this process has seeded from usage_events.
    seeded_budgets: set = field(default_factory=set)
    #: (the engine's description it was made for, {base model name: whether it is served}).
    _served_bases: tuple[Any, dict[str, bool]] | None = field(default=None, repr=False)
    #: The grammar compiler `grammars()` returns, once built.
    _grammars: Any = field(default=None, repr=False)

    def grammars(self):
        """The compiler (engine.structured_output.StructuredOutput) that checks a request's
        response_format before admission: the in-process engine's own (`structured` on its
        client; its cache then serves the engine's compile), else this gateway's over the served
        model's tokenizer (HTTP mode), built on first use."""
        if self._grammars is None:
            own = getattr(self.engine, "structured", None)
            if own is None:
                from engine.structured_output import StructuredOutput

                tok = self.engine.tokenizer
                own = StructuredOutput(tok, tok.vocab_size, set(tok.eos_token_ids))
            self._grammars = own
        return self._grammars

    def registry_settings(self) -> PlatformSettings:
        """The settings registry calls take: `settings` (as they are now) serving what the engine
        serves (EngineClient.base_model; none while no engine has described it, and uploads are
        then refused with a 503). Configured aliases that name another model than the engine's
        are logged as an error and left out (the app does not start with them when the engine
        has described its model by then: app._lifespan)."""
        base = getattr(self.engine, "base_model", None)
        if base is None:
            return self.settings
        try:
            return self.settings.serving([base])
        except ValueError as e:
            log.error("%s; resolving base model names without the configured aliases", e)
            return self.settings.model_copy(update={"base_model_aliases": {}}).serving([base])

    def serves_base(self, name: str | None) -> bool:
        """Whether an adapter version recorded for base model `name` (a served name or an alias of
        one, as the registry recorded it) is for the model the engine serves now; None (unknown)
        counts as served. Remembered per name for the engine's description."""
        if name is None:
            return True
        base = getattr(self.engine, "base_model", None)
        if self._served_bases is None or self._served_bases[0] is not base:
            self._served_bases = (base, {})
        known = self._served_bases[1]
        if name not in known:
            from adapter_registry.base_models import match_base_model

            if base is None:
                known[name] = match_base_model(name, [self.engine.model_name], {}) == [self.engine.model_name]
            else:
                known[name] = match_base_model(name, [base.name], self.registry_settings().aliases) == [base.name]
        return known[name]


async def get_gateway(request: Request) -> Gateway:
    """The app's Gateway (a dependency). Async on purpose: FastAPI runs a plain `def` dependency
    on a worker thread, a thread hop on every request for an attribute read."""
    return request.app.state.gateway
