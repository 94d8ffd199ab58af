"""EngineClient over engine worker processes (worker.py's internal API).

Requests for an adapter go to the same worker each time (a hash of the version id picks it), so
that worker keeps the adapter hot; base-model requests rotate. A worker that refuses the
connection is skipped for the next one; when none answers, or one goes silent for longer than
the read timeout mid-request, the caller gets EngineUnavailable (a 503), never a hang.

`ready()` probes every worker's GET /ready concurrently (short timeout, answers cached for
`READY_CACHE_S`), so the gateway's GET /ready is true when at least one worker would serve now.
Workers are named worker-0, worker-1, ... in what it reports: their URLs stay internal.
"""
from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import time
from pathlib import Path
from typing import AsyncIterator

import httpx

from engine.sampling_params import GenerationRequest, InvalidRequestError, RequestOutput
from engine.tokenizer import TextTokenizer
from tessera.engine_client import EngineReadiness, EngineUnavailable

log = logging.getLogger(__name__)

#: How long a readiness probe's answers are reused (a load balancer probing every second costs
#: the workers one probe each per this interval, whatever the number of gateway probes).
READY_CACHE_S = 2.0
#: Longest wait for one worker's GET /ready.
READY_TIMEOUT_S = 1.0


def load_tokenizer(model_path: Path | None) -> tuple[TextTokenizer, str, int]:
    """The base model's tokenizer, name and context length, read from its files (no weights)."""
    from gguf import GGUFReader

    from engine.loader.gguf_loader import DEFAULT_GGUF_FILE, DEFAULT_MODEL_NAME, default_model_path, read_metadata

    path = Path(model_path) if model_path else default_model_path()
    if path.is_dir():
        cfg = json.loads((path / "config.json").read_text())
        return TextTokenizer.from_hf_directory(path), path.name, int(cfg.get("max_position_embeddings", 2048))
    meta = read_metadata(GGUFReader(str(path)))
    name = DEFAULT_MODEL_NAME if path.name == DEFAULT_GGUF_FILE else path.stem
    ctx = int(meta.get(f"{meta.get('general.architecture', 'llama')}.context_length", 2048))
    return TextTokenizer.from_gguf_metadata(meta), name, ctx


class HttpEngineClient:
    def __init__(self, urls: list[str], *, secret: str, model_path: Path | None = None,
                 connect_timeout_s: float = 2.0, read_timeout_s: float = 120.0):
        if not urls:
            raise ValueError("HttpEngineClient needs at least one engine worker URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.tokenizer, self.model_name, self.max_model_len = load_tokenizer(model_path)
        self._headers = {"authorization": f"Bearer {secret}"}
        self._rr = itertools.count()
        self._readiness: tuple[float, EngineReadiness] | None = None
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=connect_timeout_s, read=read_timeout_s, write=10.0, pool=connect_timeout_s),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))

    async def start(self) -> None:
        """Learn the served model's name and context from a worker; a worker not up yet is not fatal."""
        for url in self.urls:
            try:
                r = await self.client.get(f"{url}/internal/info", headers=self._headers)
                r.raise_for_status()
                info = r.json()
                self.model_name, self.max_model_len = info["model"], int(info["max_model_len"])
                return
            except (httpx.HTTPError, KeyError, ValueError) as e:
                log.warning("engine worker %s: %s", url, e)

    async def close(self) -> None:
        await self.client.aclose()

    async def _worker_state(self, url: str) -> tuple[str, int]:
        """(state, restarts) of one worker from its GET /ready; "unreachable" when it does not answer."""
        try:
            r = await self.client.get(f"{url}/ready", timeout=READY_TIMEOUT_S)
            engine = r.json().get("engine") or {}
            state = "ready" if r.status_code == 200 else str(engine.get("state") or "not_ready")
            return state, int(engine.get("restarts") or 0)
        except (httpx.HTTPError, ValueError, AttributeError):
            return "unreachable", 0

    async def ready(self) -> EngineReadiness:
        """Ready when at least one worker answered its GET /ready with 200 (see the module
        docstring); never raises."""
        now = time.monotonic()
        if self._readiness is not None and now - self._readiness[0] < READY_CACHE_S:
            return self._readiness[1]
        states = await asyncio.gather(*(self._worker_state(u) for u in self.urls))
        engines = {f"worker-{i}": state for i, (state, _) in enumerate(states)}
        serving = sum(state == "ready" for state, _ in states)
        readiness = EngineReadiness(
            ready=serving > 0, state="ready" if serving else "unavailable",
            reason=None if serving else "no engine worker is ready (" + ", ".join(
                f"{name}: {state}" for name, state in engines.items()) + ")",
            restarts=sum(r for _, r in states), engines=engines)
        self._readiness = (time.monotonic(), readiness)
        return readiness

    def _order(self, request: GenerationRequest) -> list[str]:
        n = len(self.urls)
        if request.adapter:
            start = int(hashlib.sha256(request.adapter.encode()).hexdigest()[:8], 16) % n
        else:
            start = next(self._rr) % n
        return [self.urls[(start + i) % n] for i in range(n)]

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        body = {"request_id": request.request_id, "prompt_token_ids": request.prompt_token_ids,
                "params": request.params.model_dump(), "tenant_id": request.tenant_id,
                "priority": request.priority.name, "adapter": request.adapter}
        errors = []
        for url in self._order(request):
            try:
                async with self.client.stream("POST", f"{url}/internal/generate", json=body,
                                              headers=self._headers) as resp:
                    if resp.status_code == 400:
                        err = json.loads(await resp.aread())
                        raise InvalidRequestError(err.get("message", "invalid request"), err.get("param"))
                    if resp.status_code != 200:
                        errors.append(f"{url}: HTTP {resp.status_code}")
                        continue
                    async for line in resp.aiter_lines():
                        if not line:
                            continue
                        data = json.loads(line)
                        if "engine_dead" in data:
                            raise EngineUnavailable(f"engine worker {url} died: {data['engine_dead']}")
                        out = RequestOutput(**data)
                        yield out
                        if out.finished:
                            return
                    raise EngineUnavailable(f"engine worker {url} closed the stream early")
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as e:
                errors.append(f"{url}: {type(e).__name__}")  # nothing was sent: try the next worker
                continue
            except (httpx.HTTPError, json.JSONDecodeError) as e:
                raise EngineUnavailable(f"engine worker {url} failed mid-request: {type(e).__name__}") from e
        raise EngineUnavailable("no engine worker is reachable (" + "; ".join(errors) + ")")
