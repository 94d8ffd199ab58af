"""The engine in the gateway's own process (embedded mode and tests)."""
from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import AsyncIterator

from engine.async_engine import READY, AsyncLLMEngine, EngineDeadError
from engine.lora.weights import base_shape_of
from engine.sampling_params import GenerationRequest, RequestOutput
from tessera.engine_client import ABORT_REPORT_TIMEOUT_S, EngineReadiness, EngineUnavailable


class InProcessEngineClient:
    """EngineClient over an AsyncLLMEngine. With owns_engine, `close` shuts the engine down.

    While the engine restarts after its step loop died, `generate` raises EngineUnavailable (a
    503 from the gateway), as it does for the requests that were in flight when it died."""

    def __init__(self, aengine: AsyncLLMEngine, *, owns_engine: bool = False):
        self.aengine = aengine
        self.owns_engine = owns_engine
        self.tokenizer = aengine.tokenizer
        self.model_name = aengine.engine.model_config.name
        self.max_model_len = aengine.engine.max_model_len
        self.base_model = base_shape_of(aengine.engine.model_config)
        #: The engine's grammar compiler: the gateway checks response formats with it before
        #: admission, so the engine finds them in its cache (Gateway.grammars).
        self.structured = aengine.engine.structured

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        try:
            # aclosing: leaving this iteration early closes (aborts) the engine's at once, not
            # whenever the garbage collector finalizes it.
            async with aclosing(self.aengine.generate(request)) as outs:
                async for out in outs:
                    yield out
        except EngineDeadError as e:
            raise EngineUnavailable(f"the engine is not serving: {e}") from e

    async def abort(self, request_id: str) -> RequestOutput | None:
        report = asyncio.wrap_future(self.aengine.abort(request_id))
        # asyncio.wait, not wait_for: a timeout must not cancel the report another caller may share.
        done, _ = await asyncio.wait([report], timeout=ABORT_REPORT_TIMEOUT_S)
        return report.result() if done else None

    async def ready(self) -> EngineReadiness:
        h = self.aengine.health()
        ok = h["state"] == READY
        reason = None if ok else f"the engine is {h['state']}" + (f" ({h['last_error']})" if h["last_error"] else "")
        return EngineReadiness(ok, h["state"], reason, h["restarts"])

    async def start(self) -> None:
        if not self.aengine.is_alive:
            raise EngineUnavailable("the engine is not running")

    async def close(self) -> None:
        if self.owns_engine:
            self.aengine.shutdown()


def build_inprocess_client(settings, adapter_source=None) -> InProcessEngineClient:
    """Load the base model from settings (model_path, served as model_name; default: the embedded
    SmolLM2) into an owned engine."""
    from tessera.engine_config import engine_config_from_settings
    from tessera.served_model import load_engine

    config = engine_config_from_settings(settings)
    engine = load_engine(settings.model_path, config, model_name=settings.model_name, adapter_source=adapter_source)
    return InProcessEngineClient(AsyncLLMEngine(engine), owns_engine=True)
