"""How the gateway talks to engines: one interface, two implementations.

- inprocess.InProcessEngineClient: an AsyncLLMEngine in this process (embedded mode);
- http.HttpEngineClient: engine worker processes (worker.py) over their internal streaming API.

`generate(request)` yields RequestOutput deltas exactly like AsyncLLMEngine.generate: it raises
InvalidRequestError before the first delta for a request the engine refuses, EngineUnavailable
when no engine can serve (dead, unreachable, or it stopped answering); leaving the iteration
early aborts the request in the engine.
"""
from __future__ import annotations

from typing import AsyncIterator, Protocol

from engine.sampling_params import GenerationRequest, RequestOutput
from engine.tokenizer import TextTokenizer


class EngineUnavailable(RuntimeError):
    """No engine could serve the request (the gateway answers 503)."""


class EngineClient(Protocol):
    model_name: str
    max_model_len: int
    tokenizer: TextTokenizer

    def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...
