"""The response to an admitted completion request: the engine call, then either an SSE stream or
one JSON answer; every way it ends records one usage event and settles the quota reservation to
the tokens really used (`Generation.finish`, exactly once).

The first delta is awaited before answering (`start`), so a refusal or a failure before any
token is a 4xx/503, not a broken stream. Billing of a client that disconnects: the engine
request is aborted (its KV blocks freed) and the usage event (status "aborted") counts the
completion tokens the client was sent: a stream's forwarded tokens, a JSON answer's none.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.sampling_params import GenerationRequest, InvalidRequestError, Priority, RequestOutput
from tessera.api.completions_request import Job, invalid
from tessera.api.failures import engine_error, unavailable
from tessera.engine_client import EngineUnavailable
from tessera.errors import ApiError
from tessera.gateway import Gateway
from tessera.metering import Usage
from tessera.quota import Decision
from tessera.services import Caller
from tessera.streaming import (
    ClientDisconnected,
    DisconnectAwareStream,
    Final,
    cancel_on_disconnect,
)

_FINISH = {"stop": "stop", "length": "length", "abort": "stop", "error": "stop"}


@dataclass
class Generation:
    """One admitted request from its engine call to its usage event: what every step of the
    response needs."""

    gw: Gateway
    caller: Caller
    job: Job
    decision: Decision  # holds the quota reservation `finish` settles
    stream: AsyncGenerator[RequestOutput, None]  # the engine's deltas; aclose() aborts the request
    headers: dict[str, str]  # rate-limit headers and x-request-id, on every answer
    first: RequestOutput | None = None  # the first delta (set by `start`)
    ttft: float | None = None  # seconds from the request's start to the first delta

    async def finish(self, *, status: str, finish_reason: str | None, completion_tokens: int) -> Usage:
        """Record the usage event, then settle the quota to the tokens really used (shielded:
        runs even when the request is being cancelled). A request that failed with nothing
        generated is billed no prompt tokens."""
        gw, job = self.gw, self.job
        with anyio.CancelScope(shield=True):
            prompt = len(job.prompt_ids) if status != "error" or completion_tokens else 0
            usage = Usage(request_id=job.request_id, tenant_id=self.caller.tenant_id, api_key_id=self.caller.key_id,
                          model=job.model, adapter_version=job.adapter, priority=job.priority,
                          prompt_tokens=prompt, completion_tokens=completion_tokens, status=status,
                          finish_reason=finish_reason, ttft_ms=None if self.ttft is None else self.ttft * 1000.0,
                          duration_ms=(time.perf_counter() - job.started) * 1000.0,
                          base_model=gw.engine.model_name)
            await gw.meter.record(usage)
            await gw.quota.settle(self.decision.reservation, used_tokens=prompt + completion_tokens)
            return usage

    def failed(self, out: RequestOutput) -> ApiError:
        return engine_error(request_id=self.job.request_id, model=self.job.model, out=out)


async def start(*, gw: Gateway, caller: Caller, job: Job, decision: Decision,
                headers: dict[str, str]) -> Generation:
    """Submit the job to the engine and wait for its first delta. Raises ApiError (after
    settling the reservation): 400 when the engine refuses the request, 503 when no engine is
    available, the engine's error when it fails before any token."""
    request = GenerationRequest(request_id=job.request_id, prompt_token_ids=job.prompt_ids, params=job.params,
                                tenant_id=str(caller.tenant_id), priority=Priority.parse(job.priority),
                                adapter=job.adapter, cache_salt=f"tenant:{caller.tenant_id}")
    gen = Generation(gw=gw, caller=caller, job=job, decision=decision, stream=gw.engine.generate(request),
                     headers=headers)
    try:
        gen.first = await gen.stream.__anext__()
    except InvalidRequestError as e:
        # The caller's mistake, caught by the engine before any work: nothing to bill, and not a
        # server error (a usage event with status "error" would count against availability
        # SLOs). Release the reservation like every other 4xx, which never reaches the engine.
        with anyio.CancelScope(shield=True):
            await gw.quota.settle(decision.reservation, used_tokens=0)
        raise invalid(e) from None
    except EngineUnavailable as e:
        await gen.finish(status="error", finish_reason=None, completion_tokens=0)
        raise unavailable(job.request_id, "no engine is available", e, code="engine_unavailable") from None
    except BaseException:
        await gen.stream.aclose()
        await gen.finish(status="aborted", finish_reason=None, completion_tokens=0)
        raise
    if gen.first.finished and gen.first.finish_reason == "error":
        # Failed before any token (its adapter could not be loaded): an error status, streaming
        # or not, rather than a 200 whose only event is the error.
        await gen.finish(status="error", finish_reason="error", completion_tokens=len(gen.first.token_ids))
        raise gen.failed(gen.first)
    gen.ttft = time.perf_counter() - job.started
    return gen


async def respond(gen: Generation, http: Request) -> Response:
    """The answer to a started generation: an SSE stream, or one JSON body once the whole
    completion is ready (aborted, and answered 499 to nobody, if the client leaves first)."""
    if gen.job.stream:
        return DisconnectAwareStream(_events(gen), media_type="text/event-stream",
                                     headers=gen.headers | {"cache-control": "no-cache", "x-accel-buffering": "no"})

    try:
        return await cancel_on_disconnect(http.receive, lambda: _collect(gen))
    except ClientDisconnected:
        return Response(status_code=499)  # nobody reads it; the usage event says "aborted"


async def _collect(gen: Generation) -> JSONResponse:
    """The whole completion as one JSON body (chat.completion or text_completion)."""
    job = gen.job
    parts, out, completion = [], gen.first, 0
    try:
        while True:
            parts.append(out.text)
            completion += len(out.token_ids)
            if out.finished:
                break
            out = await gen.stream.__anext__()
    except EngineUnavailable as e:
        await gen.finish(status="error", finish_reason=None, completion_tokens=completion)
        raise unavailable(job.request_id, "the engine failed mid-request", e, code="engine_unavailable") from None
    except BaseException:  # cancelled: the client went away before the answer was ready
        await gen.stream.aclose()
        # Billed for what it was sent, as a stream that disconnects is: here nothing.
        await gen.finish(status="aborted", finish_reason=None, completion_tokens=0)
        raise
    if out.finish_reason == "error":
        await gen.finish(status="error", finish_reason="error", completion_tokens=completion)
        raise gen.failed(out)
    await gen.finish(status="completed", finish_reason=out.finish_reason, completion_tokens=completion)
    text = "".join(parts)
    finish = _FINISH.get(out.finish_reason, "stop")
    if job.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    return JSONResponse({"id": job.request_id, "object": obj, "created": job.created, "model": job.model,
                         "choices": [choice], "usage": _usage_dict(len(job.prompt_ids), completion)},
                        headers=gen.headers)


async def _events(gen: Generation):
    """SSE body: one chunk per engine delta, the usage chunk if asked, then [DONE]. Chunks produced
    at the same moment go out in one write (the role chunk with the first delta; the last delta,
    usage, [DONE] and the end of the body together). The usage event is durable before the last
    write; on a disconnect the `finally` records what was forwarded."""
    job = gen.job
    completion, done = 0, False
    try:
        pending = _sse(_chunk(job, None, None, first=True)) if job.kind == "chat" else b""
        out = gen.first
        while True:
            completion += len(out.token_ids)  # counted as forwarded: the chunk is written next
            if out.finished:
                break
            if out.text:
                yield pending + _sse(_chunk(job, out.text, None))
                pending = b""
            out = await gen.stream.__anext__()
        done = True
        if out.finish_reason == "error":
            await gen.finish(status="error", finish_reason="error", completion_tokens=completion)
            yield Final(pending + _sse(gen.failed(out).body()))
            return
        finish = _FINISH.get(out.finish_reason, "stop")
        if job.kind == "chat":
            if out.text:
                pending += _sse(_chunk(job, out.text, None))
            pending += _sse(_chunk(job, None, finish))
        else:
            pending += _sse(_chunk(job, out.text, finish))
        await gen.finish(status="completed", finish_reason=out.finish_reason, completion_tokens=completion)
        if job.include_usage:
            pending += _sse({"id": job.request_id, "created": job.created, "model": job.model, "choices": [],
                             "object": "chat.completion.chunk" if job.kind == "chat" else "text_completion",
                             "usage": _usage_dict(len(job.prompt_ids), completion)})
        yield Final(pending + _sse("[DONE]"))
    except EngineUnavailable as e:
        if not done:
            done = True
            await gen.finish(status="error", finish_reason=None, completion_tokens=completion)
            yield Final(_sse(unavailable(job.request_id, "the engine failed mid-request", e,
                                         code="engine_unavailable").body()))
    finally:
        with anyio.CancelScope(shield=True):
            await gen.stream.aclose()  # aborts the engine request if it is still running
            if not done:
                await gen.finish(status="aborted", finish_reason="abort", completion_tokens=completion)


def _usage_dict(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _chunk(job: Job, text: str | None, finish: str | None, *, first: bool = False) -> dict:
    """One SSE chunk object: chat.completion.chunk (the first one carries the role) or text_completion."""
    if job.kind == "chat":
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text is not None else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    c = {"id": job.request_id, "object": obj, "created": job.created, "model": job.model, "choices": [choice]}
    if job.include_usage:
        c["usage"] = None
    return c


def _sse(data: dict | str) -> bytes:
    return b"data: " + (data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))).encode() + b"\n\n"
