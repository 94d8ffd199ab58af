"""The engine in the gateway's own process (embedded mode and tests)."""
from __future__ import annotations

from typing import AsyncIterator

from engine.async_engine import AsyncLLMEngine, EngineDeadError
from engine.sampling_params import GenerationRequest, RequestOutput
from tessera.engine_client import EngineUnavailable


class InProcessEngineClient:
    """EngineClient over an AsyncLLMEngine. With owns_engine, `close` shuts the engine down."""

    def __init__(self, aengine: AsyncLLMEngine, *, owns_engine: bool = False):
        self.aengine = aengine
        self.owns_engine = owns_engine
        self.tokenizer = aengine.tokenizer
        self.model_name = aengine.engine.model_config.name
        self.max_model_len = aengine.engine.max_model_len

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        try:
            async for out in self.aengine.generate(request):
                yield out
        except EngineDeadError as e:
            raise EngineUnavailable(f"the engine is not running: {e}") from e

    async def start(self) -> None:
        if not self.aengine.is_alive:
            raise EngineUnavailable("the engine is not running")

    async def close(self) -> None:
        if self.owns_engine:
            self.aengine.shutdown()


def build_inprocess_client(settings, adapter_source=None) -> InProcessEngineClient:
    """Load the base model from settings (default: embedded SmolLM2) into an owned engine."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    config = EngineConfig(kv_cache_bytes=settings.engine_kv_cache_mib << 20, num_threads=settings.engine_threads)
    engine = LLMEngine(settings.model_path, config, adapter_source=adapter_source)
    return InProcessEngineClient(AsyncLLMEngine(engine), owns_engine=True)
