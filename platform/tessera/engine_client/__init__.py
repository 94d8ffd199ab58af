"""How the gateway talks to engines: one interface, two implementations.

- inprocess.InProcessEngineClient: an AsyncLLMEngine in this process (embedded mode);
- http.HttpEngineClient: engine worker processes (worker.py) over their internal streaming API.

`generate(request)` yields RequestOutput deltas exactly like AsyncLLMEngine.generate: it raises
InvalidRequestError before the first delta for a request the engine refuses, EngineUnavailable
when no engine can serve (dead, restarting, unreachable, or it stopped answering); leaving the
iteration early (also while waiting for the first delta) aborts the request in the engine before
its next step. `abort(request_id)` then says what the aborted request cost: its final output as
the engine reported it (`computed_prompt_tokens`: how far its prefill got), or None when no
report came within `ABORT_REPORT_TIMEOUT_S` (the engine had not received it, had finished it, or
cannot be reached). `ready()` says whether a request sent now would find an engine (the
gateway's GET /ready).

`model_name` is the served base model's name, `base_model` its description for LoRA
(engine.lora.peft_format.BaseModelShape: architecture, layers, modules and shapes) as the engine
gives it: the registry checks uploads against it (Gateway.registry_settings). Over HTTP it is
None until a worker serving this deployment's model has published it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

from engine.lora.peft_format import BaseModelShape
from engine.sampling_params import GenerationRequest, RequestOutput
from engine.tokenizer import TextTokenizer


#: Longest wait for an abort's report: the engine aborts between two steps, so one step's time
#: (plus a hop to an engine worker).
ABORT_REPORT_TIMEOUT_S = 10.0


class EngineUnavailable(RuntimeError):
    """No engine could serve the request (the gateway answers 503)."""


@dataclass
class EngineReadiness:
    """Whether an engine can serve now. `state`: the engine's ("ready", "restarting", "failed",
    "stopped"; over HTTP "ready" when a worker is, else "unavailable"); `reason`: why not, or
    (HTTP) why a worker is refused although others serve (it serves another model), for the
    operator (no tenant data); `engines`: per engine worker (HTTP mode), worker-<i> -> its state
    (an engine state, "unreachable", or "wrong_model")."""

    ready: bool
    state: str
    reason: str | None = None
    restarts: int = 0
    engines: dict[str, str] = field(default_factory=dict)


class EngineClient(Protocol):
    model_name: str
    max_model_len: int
    tokenizer: TextTokenizer
    #: The served model's description (None over HTTP until a worker has published it).
    base_model: BaseModelShape | None

    def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> RequestOutput | None:
        """Abort the request (if its engine still holds it) and return the abort's report (module
        docstring); never raises for an engine that is gone."""
        ...

    async def ready(self) -> EngineReadiness:
        """Ready when an engine would take a request now: in process, its state is "ready"; over
        HTTP, at least one engine worker answered its GET /ready recently. Never raises."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...
