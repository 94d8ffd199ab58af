"""The response to an admitted completion request: the engine calls, then either an SSE stream or
one JSON answer; every way it ends records one usage event and settles the quota reservation to
the tokens really used (`Generation.finish`, exactly once).

One consumer reads a started generation's deltas, `_Fold.steps`, and folds them into the
request's result (each choice's reply, finish reason and tokens read and shown, the failure);
the JSON answer (`collect`) and the SSE stream (`chunk_groups`) are two renderers over it.
Usage is recorded once per request, by one rule, in one of two places:
- `start`, when the request ends before its answer begins: the engine refused it (no event; the
  reservation is released), no engine or a choice failed before any token (status "error", the
  engine's error), or it was cancelled meanwhile (status "aborted");
- otherwise the consumer, in its `finally` (after aborting the choices still running): every
  choice finished: status "completed", choice 0's finish_reason, every completion token; an
  engine failure (a choice's error delta: "error", or "aborted" when the client's input caused it,
  finish_reason "error"; EngineUnavailable: "error", none); ended any other way (closed early,
  cancelled: the client went away): "aborted" (finish_reason "abort" for a stream, none for a
  JSON answer). A stream that ended early bills, per choice, the completion tokens its chunks
  showed; a JSON answer, never sent, none, but every token generated on a server error ("error").

The first delta is awaited before answering (`start`), so a refusal or a failure before any
token is a 4xx/503, not a broken stream. A client that disconnects at any moment (while the
request waits for a seat or is prefilled too: the routes await `start` listening for the
disconnect) has its engine requests aborted before the engine's next step (their KV blocks and
seats freed), and the usage event (status "aborted") bills what was computed and sent:
- prompt tokens: those the engine prefilled before the abort (the abort's report,
  EngineClient.abort: `computed_prompt_tokens`, the most over the choices); every prompt token
  once any choice produced a token; 0 when the engine never scheduled it. Without a report
  (none came in time) the count is what the deltas read show (the whole prompt after a token,
  else 0). Cached tokens: of those, the ones choice 0 found in the prefix cache.
- completion tokens: those the client was sent (the tokens a stream's chunks showed; a JSON
  answer's none).

`n` choices are `n` engine requests with the same prompt (ids: the job's, then the job's + "-i"):
choice 0 starts first and its first delta is awaited, by when the engine's prefix cache holds the
prompt's KV blocks; choices 1..n-1 then start together and reuse them. With a `seed`, choice i
samples with seed + i (wrapped into int64): the choices differ, and repeat. Their deltas are
read in turn (the engine steps them together) and answered as choices[i] / chunks with index i.
The one usage event counts the prompt once and the completion tokens of every choice, and
cached_tokens from choice 0; an engine error in any choice, an abort or a disconnect ends (and
aborts) all of them.
"""
from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.sampling_params import SEED_MIN, GenerationRequest, InvalidRequestError, Priority, RequestOutput
from tessera.api import logprobs as api_logprobs
from tessera.api.completions_request import Job, invalid
from tessera.api.failures import engine_error, failure_status, unavailable
from tessera.engine_client import EngineUnavailable
from tessera.errors import ApiError
from tessera.gateway import Gateway
from tessera.metering import Usage
from tessera.observability import tracing
from tessera.quota import Decision
from tessera.services import Caller
from tessera.streaming import (
    ClientDisconnected,
    DisconnectAwareStream,
    Final,
    cancel_on_disconnect,
)
from tessera.tool_calls import StreamParser, parse

_FINISH = {"stop": "stop", "length": "length", "abort": "stop", "error": "stop"}
_INT64 = 1 << 64


@dataclass
class Choice:
    """One of the request's `n` completions: its engine request and what its answer needs."""

    index: int
    request_id: str  # its engine request's id
    prompt_tokens: int  # the prompt's length
    stream: AsyncGenerator[RequestOutput, None]  # the engine's deltas; aclose() aborts the request
    logprobs: api_logprobs.ChoiceLogprobs | None  # when the request asked for logprobs
    first: RequestOutput | None = None  # the first delta (set by `start`)
    error: Exception | None = None  # what awaiting the first delta raised
    ended: bool = False  # its finished delta was read
    computed_prompt: int = 0  # prompt tokens the engine computed for it, as far as known
    reported: bool = False  # the abort's report was asked for (`Generation.close`)

    async def next(self) -> RequestOutput:
        """The next delta (StopAsyncIteration after the last), noting what it says was computed."""
        out = await self.stream.__anext__()
        self.note(out)
        return out

    def note(self, out: RequestOutput) -> None:
        """Note what `out` (a delta, or the abort's report) says was computed of the prompt: all
        of it once there is a token (the engine prefills the whole prompt first)."""
        self.ended = self.ended or out.finished
        done = self.prompt_tokens if out.token_ids else 0
        self.computed_prompt = min(self.prompt_tokens, max(self.computed_prompt, out.computed_prompt_tokens, done))

    async def first_delta(self) -> None:
        """Await the first delta; an exception is kept in `error` for `start` to answer (a
        cancellation propagates)."""
        try:
            self.first = await self.next()
        except Exception as e:  # noqa: BLE001 - answered by `start`, the same for every choice
            self.error = e


@dataclass
class Generation:
    """One admitted request from its engine calls to its usage event: what every step of the
    response needs."""

    gw: Gateway
    caller: Caller
    job: Job
    decision: Decision  # holds the quota reservation `finish` settles
    headers: dict[str, str]  # rate-limit headers and x-request-id, on every answer
    choices: list[Choice] = field(default_factory=list)
    ttft: float | None = None  # seconds from the request's start to choice 0's first delta
    cached_tokens: int = 0  # prompt tokens choice 0 found in the prefix cache (its latest delta's)

    async def finish(self, *, status: str, finish_reason: str | None, completion_tokens: int) -> Usage:
        """Record the usage event, then settle the quota to the tokens really used (shielded:
        runs even when the request is being cancelled). A request that failed with nothing
        generated is billed no prompt tokens; an aborted one the prompt tokens the engine
        computed (module docstring; `close` has collected the abort reports)."""
        gw, job = self.gw, self.job
        with anyio.CancelScope(shield=True):
            if status == "aborted":
                prompt = max((c.computed_prompt for c in self.choices), default=0)
            else:
                prompt = len(job.prompt_ids) if status != "error" or completion_tokens else 0
            usage = Usage(request_id=job.request_id, tenant_id=self.caller.tenant_id, api_key_id=self.caller.key_id,
                          model=job.model, adapter_version=job.adapter, priority=job.priority,
                          prompt_tokens=prompt, completion_tokens=completion_tokens, status=status,
                          finish_reason=finish_reason, ttft_ms=None if self.ttft is None else self.ttft * 1000.0,
                          duration_ms=(time.perf_counter() - job.started) * 1000.0,
                          base_model=gw.engine.model_name, cached_tokens=min(self.cached_tokens, prompt),
                          end_user=job.user, safety_identifier=job.safety_identifier)
            await gw.meter.record(usage)
            await gw.quota.settle(self.decision.reservation, used_tokens=prompt + completion_tokens)
            tracing.annotate(prompt_tokens=prompt, completion_tokens=completion_tokens, cached_tokens=usage.cached_tokens,
                             finish_reason=finish_reason, usage_status=status)
            return usage

    async def close(self) -> None:
        """Abort every choice's engine request that is still running, and collect the abort
        reports (shielded; at most one engine step, or EngineClient's ABORT_REPORT_TIMEOUT_S)."""
        with anyio.CancelScope(shield=True):
            for c in self.choices:
                await c.stream.aclose()
            # A choice whose first delta raised never ran (refused, or no engine); an engine
            # client without `abort` (a test double) gives no report: the deltas' counts stand.
            abort = getattr(self.gw.engine, "abort", None)
            pending = [c for c in self.choices if not (c.ended or c.reported or c.error is not None)]
            if abort is None or not pending:
                return

            async def report(c: Choice) -> None:
                c.reported = True
                out = await abort(c.request_id)
                if out is not None:
                    c.note(out)
                    if c.index == 0:
                        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)

            async with anyio.create_task_group() as tg:
                for c in pending:
                    tg.start_soon(report, c)

    def seen(self, c: Choice, out: RequestOutput) -> None:
        """Note a delta of choice `c` (choice 0's carries the prompt's cached tokens)."""
        if c.index == 0:
            self.cached_tokens = out.cached_tokens
        if c.logprobs is not None:
            c.logprobs.push(out.logprobs)

    def failed(self, out: RequestOutput) -> ApiError:
        return engine_error(request_id=self.job.request_id, model=self.job.model, out=out)


def choice_request(job: Job, caller: Caller, i: int) -> GenerationRequest:
    """Choice i's engine request: the job's id (choice 0) or the job's id + "-i", and seed + i."""
    params = job.params
    if i and params.seed is not None:
        params = params.model_copy(update={"seed": (params.seed + i - SEED_MIN) % _INT64 + SEED_MIN})
    return GenerationRequest(request_id=job.request_id if i == 0 else f"{job.request_id}-{i}",
                             prompt_token_ids=job.prompt_ids, params=params, tenant_id=str(caller.tenant_id),
                             priority=Priority.parse(job.priority), adapter=job.adapter,
                             tenant_weight=caller.policy.scheduling_weight,
                             cache_salt=f"tenant:{caller.tenant_id}")


async def start(*, gw: Gateway, caller: Caller, job: Job, decision: Decision,
                headers: dict[str, str]) -> Generation:
    """Submit the job's choices to the engine (module docstring) and wait for their first
    deltas. Raises ApiError (after aborting every choice and settling the reservation): 400 when
    the engine refuses the request, 503 when no engine is available, the engine's error when a
    choice fails before any token."""
    gen = Generation(gw=gw, caller=caller, job=job, decision=decision, headers=headers)
    texts = api_logprobs.token_texts(gw.engine.tokenizer) if job.params.logprobs is not None else None

    def add(i: int) -> Choice:
        request = choice_request(job, caller, i)
        c = Choice(index=i, request_id=request.request_id, prompt_tokens=len(job.prompt_ids),
                   stream=tracing.engine_call(gw.engine.generate(request), request),
                   logprobs=api_logprobs.ChoiceLogprobs(texts, job.kind) if texts else None)
        gen.choices.append(c)
        return c

    try:
        await add(0).first_delta()
        await _check_firsts(gen)
        gen.ttft = time.perf_counter() - job.started
        if job.n > 1:
            async with anyio.create_task_group() as tg:
                for i in range(1, job.n):
                    tg.start_soon(add(i).first_delta)
            await _check_firsts(gen)
    except ApiError:
        raise
    except BaseException:
        await gen.close()
        await gen.finish(status="aborted", finish_reason=None, completion_tokens=0)
        raise
    for c in gen.choices:
        gen.seen(c, c.first)
    return gen


async def _check_firsts(gen: Generation) -> None:
    """Raise the answer to the first choice whose first delta failed (every choice aborted and
    the reservation settled first); return if none did."""
    for c in gen.choices:
        if c.error is None and not (c.first.finished and c.first.finish_reason == "error"):
            continue
        await gen.close()
        if isinstance(c.error, InvalidRequestError):
            # The caller's mistake, caught by the engine before any work: nothing to bill, and not
            # a server error (a usage event with status "error" would count against availability
            # SLOs). Release the reservation like every other 4xx, which never reaches the engine.
            with anyio.CancelScope(shield=True):
                await gen.gw.quota.settle(gen.decision.reservation, used_tokens=0)
            raise invalid(c.error) from None
        if isinstance(c.error, EngineUnavailable):
            await gen.finish(status="error", finish_reason=None, completion_tokens=0)
            raise unavailable(gen.job.request_id, "no engine is available", c.error,
                              code="engine_unavailable") from None
        if c.error is not None:
            raise c.error
        # Failed before any token (its adapter could not be loaded): an error status, streaming
        # or not, rather than a 200 whose only event is the error.
        await gen.finish(status=failure_status(c.first), finish_reason="error",
                         completion_tokens=len(c.first.token_ids))
        raise gen.failed(c.first)


class _Turns:
    """The choices' deltas, one at a time: every first delta, then one delta of each unfinished
    choice in turn (the engine steps them together, so none waits long behind another)."""

    def __init__(self, choices: list[Choice]):
        self._firsts = deque(choices)
        self._turn: deque[Choice] = deque()

    @property
    def running(self) -> int:
        """Choices not yet finished (their first delta not yet read counts as running)."""
        return len(self._turn) + sum(1 for c in self._firsts if not c.first.finished)

    async def next(self) -> tuple[Choice, RequestOutput] | None:
        """The next (choice, delta), or None once every choice has finished."""
        if self._firsts:
            c = self._firsts.popleft()
            out = c.first
        elif self._turn:
            c = self._turn.popleft()
            out = await c.next()
        else:
            return None
        if not out.finished:
            self._turn.append(c)
        return c, out


async def respond(gen: Generation, http: Request) -> Response:
    """The answer to a started generation: an SSE stream, or one JSON body once the whole
    completion is ready (aborted, and answered 499 to nobody, if the client leaves first)."""
    if gen.job.stream:
        return DisconnectAwareStream(_events(gen), media_type="text/event-stream",
                                     headers=gen.headers | {"cache-control": "no-cache", "x-accel-buffering": "no"})

    try:
        body = await cancel_on_disconnect(http.receive, lambda: collect(gen))
    except ClientDisconnected:
        return Response(status_code=499)  # nobody reads it; the usage event says "aborted"
    return JSONResponse(body, headers=gen.headers)


async def collect_chat(gen: Generation) -> dict:
    """A chat generation's whole chat.completion object (`collect`): the Responses API's entry."""
    assert gen.job.kind == "chat"
    return await collect(gen)


def stream_chat(gen: Generation) -> AsyncGenerator[dict, None]:
    """A chat generation's chat.completion.chunk objects (`chunk_groups`, one by one, the usage
    chunk always last): the Responses API's entry. Closing it early aborts and bills what was
    yielded, as a client that disconnects."""
    assert gen.job.kind == "chat"
    gen.job.include_usage = True

    async def chunks():
        async with aclosing(chunk_groups(gen)) as groups:
            async for group in groups:
                for c in group:
                    yield c
    return chunks()


class _Reply:
    """One choice's reply as its client gets it: the text, the tool calls read out of it
    (tessera.tool_calls) when the request offered tools, and the logprobs released so far."""

    def __init__(self, job: Job, c: Choice):
        self.job, self.choice = job, c
        self.parser = StreamParser(job.tools, job.tool_format) if job.tools is not None else None
        self.texts: list[str] = []
        self.logprobs: list[dict] = []  # released, not yet sent (a stream) or all (a JSON answer)

    def push(self, out: RequestOutput) -> None:
        self.texts.append(out.text)
        lp = self.choice.logprobs
        if lp is not None and (part := lp.release(out.text, final=out.finished)) is not None:
            self.logprobs.append(part)

    def take_logprobs(self) -> dict | None:
        parts, self.logprobs = self.logprobs, []
        return api_logprobs.merge(self.job.kind, parts) if parts else None

    def message(self, finish_reason: str) -> tuple[dict, str]:
        """(the chat message, the OpenAI finish_reason) of the finished reply."""
        text = "".join(self.texts)
        if self.parser is None:
            return {"role": "assistant", "content": text}, _FINISH.get(finish_reason, "stop")
        content, calls = parse(text, self.job.tools, self.job.tool_format)
        msg = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = [call.as_openai() for call in calls]
        return msg, self._finish(finish_reason, bool(calls))

    def deltas(self, text: str, final: bool) -> list[dict]:
        """The chunk deltas `text` (the next engine text) gives, and at the end what was held."""
        if self.parser is None:
            return [{"content": text}] if text else []
        out = self.parser.feed(text) if text else []
        if final:
            out += self.parser.finish()
        return [d.as_openai() for d in out if d.index is not None or d.content]

    def stream_finish(self, finish_reason: str) -> str:
        return self._finish(finish_reason, self.parser is not None and self.parser.calls > 0)

    def _finish(self, finish_reason: str, called: bool) -> str:
        # As OpenAI: "tool_calls" when the model chose to call; a call the request forced by
        # name ends as "stop".
        if called and self.job.tools.mode != "named":
            return "tool_calls"
        return _FINISH.get(finish_reason, "stop")


class _Fold:
    """A started generation's result, folded from its engine deltas by the one consumer, `steps`:
    each choice's reply (text, tool calls, logprobs: `_Reply`) and last delta, the completion
    tokens read and shown per choice, and the failure that ended it. `collect` renders the result
    as one JSON body; `chunk_groups` renders each step as SSE chunks."""

    def __init__(self, gen: Generation, *, stream: bool):
        self.gen = gen
        self.stream = stream  # answered as SSE chunks (else one JSON body, sent at the end)
        self.replies = [_Reply(gen.job, c) for c in gen.choices]
        self.finals: dict[int, RequestOutput] = {}  # each finished choice's last delta
        # Per choice: the completion tokens read, and how many of them a chunk has shown (`show`;
        # a token whose text is held back, an incomplete character or a tool call's prefix, shows
        # with a later one).
        self.counted = [0] * len(gen.choices)
        self.shown = [0] * len(gen.choices)
        self.failure: ApiError | None = None  # the answer to an engine failure that ended it
        self._turns = _Turns(gen.choices)

    @property
    def completion(self) -> int:
        """Completion tokens read so far, every choice."""
        return sum(self.counted)

    @property
    def running(self) -> int:
        """Choices not yet finished."""
        return self._turns.running

    def show(self, index: int) -> None:
        """A chunk of choice `index` is sent: every token read of it counts as shown."""
        self.shown[index] = self.counted[index]

    def billed(self, status: str) -> int:
        """The completion tokens the usage event of an ending with `status` bills (module
        docstring): all of them when completed; else a stream's shown ones, and a JSON answer's
        (never sent) none, but all of them on a server error ("error")."""
        if status == "completed":
            return self.completion
        if self.stream:
            return sum(self.shown)
        return self.completion if status == "error" else 0

    async def steps(self) -> AsyncGenerator[tuple[Choice, RequestOutput], None]:
        """Read every choice's deltas (`_Turns` order), fold each in and yield (choice, delta);
        stop at an engine failure (`failure`: a choice's error delta, which is not yielded, or
        EngineUnavailable). However it ends (every choice finished, a failure, closed early or
        cancelled: the client went away), the engine requests still running are aborted and the
        generation is finished exactly once, in the `finally` (module docstring)."""
        gen = self.gen
        status, finish_reason = "aborted", "abort" if self.stream else None
        try:
            while (item := await self._turns.next()) is not None:
                c, out = item
                if out is not c.first:
                    gen.seen(c, out)
                self.counted[c.index] += len(out.token_ids)
                if out.finished:
                    self.finals[c.index] = out
                if out.finish_reason == "error":
                    self.failure = gen.failed(out)
                    status, finish_reason = failure_status(out), "error"
                    return
                self.replies[c.index].push(out)
                yield c, out
            status, finish_reason = "completed", self.finals[0].finish_reason
        except EngineUnavailable as e:
            self.failure = unavailable(gen.job.request_id, "the engine failed mid-request", e,
                                       code="engine_unavailable")
            status, finish_reason = "error", None
        finally:
            await gen.close()  # aborts the choices still running, collects their reports (shielded)
            await gen.finish(status=status, finish_reason=finish_reason, completion_tokens=self.billed(status))


async def collect(gen: Generation) -> dict:
    """The whole completion as one JSON object (chat.completion or text_completion), n choices:
    the folded result (`_Fold`) rendered once every choice finished. Raises the ApiError of an
    engine failure; a cancellation (the client went away) aborts and bills no completion."""
    job = gen.job
    fold = _Fold(gen, stream=False)
    async with aclosing(fold.steps()) as steps:
        async for _ in steps:
            pass  # the answer is the folded result
    if fold.failure is not None:
        raise fold.failure
    choices = []
    for c, reply in zip(gen.choices, fold.replies):
        logprobs = reply.take_logprobs() if c.logprobs is not None else None
        final = fold.finals[c.index]
        if job.kind == "chat":
            message, finish = reply.message(final.finish_reason)
            choices.append({"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": finish})
        else:
            choices.append({"index": c.index, "text": "".join(reply.texts), "logprobs": logprobs,
                            "finish_reason": _FINISH.get(final.finish_reason, "stop")})
    return {"id": job.request_id, "object": "chat.completion" if job.kind == "chat" else "text_completion",
            "created": job.created, "model": job.model, "choices": choices,
            "usage": _usage_dict(len(job.prompt_ids), fold.completion, gen.cached_tokens)}


async def _events(gen: Generation):
    """SSE body: each group of `chunk_groups` in one write, then [DONE] after a completed one;
    the last write is Final (sent with the end of the body)."""
    async with aclosing(chunk_groups(gen)) as groups:
        async for group in groups:
            data = b"".join(_sse(c) for c in group)
            if group.last:
                yield Final(data if group.failed else data + _sse("[DONE]"))
            else:
                yield data


class _Group(list):
    """Chunks written together; `last`: the stream's end (`failed`: an error body ends it)."""

    last = False
    failed = False


async def chunk_groups(gen: Generation) -> AsyncGenerator[_Group, None]:
    """The stream's chunk objects, in groups written together, rendered from the folded steps
    (`_Fold`): the role chunks with the first delta; a group per engine delta that has something
    to send (text, or a tool call's start or arguments, each its own chunk); the last deltas, the
    usage chunk (with include_usage) in the last group. The usage event is durable before the last
    group is yielded; an engine failure ends the stream with the error body. Closed early (the
    client went away), the engine requests are aborted and the completion tokens its chunks showed
    are billed (status "aborted"), as on a failure."""
    job = gen.job
    fold = _Fold(gen, stream=True)
    prompt = len(job.prompt_ids)

    def chunk(index: int, delta: dict | None, finish: str | None = None, logprobs: dict | None = None) -> dict:
        fold.show(index)
        usage = _usage_dict(prompt, fold.completion, gen.cached_tokens) if job.continuous_usage else None
        return _chunk(job, index, delta, finish, logprobs, usage=usage)

    usage0 = _usage_dict(prompt, 0, gen.cached_tokens) if job.continuous_usage else None
    pending = _Group(_chunk(job, c.index, None, None, first=True, usage=usage0) for c in gen.choices) \
        if job.kind == "chat" else _Group()
    async with aclosing(fold.steps()) as steps:
        async for c, out in steps:
            reply = fold.replies[c.index]
            if job.kind == "chat":
                for d in reply.deltas(out.text, out.finished):
                    pending.append(chunk(c.index, d, None, reply.take_logprobs()))
                if out.finished:
                    finish = reply.stream_finish(out.finish_reason)
                    pending.append(chunk(c.index, {}, finish, reply.take_logprobs()))
            else:
                finish = _FINISH.get(out.finish_reason, "stop") if out.finished else None
                if out.text or finish or reply.logprobs:
                    pending.append(chunk(c.index, {"text": out.text}, finish, reply.take_logprobs()))
            if pending and (not out.finished or fold.running):  # the last end goes out with the usage
                yield pending
                pending = _Group()
    # Finished (the usage event recorded): the held chunks and the usage chunk, or the error body.
    if fold.failure is not None:
        # Nothing is held at a failure: a choice still running means every chunk went out.
        pending = _Group([fold.failure.body()])
        pending.failed = True
    elif job.include_usage:
        pending.append({"id": job.request_id, "created": job.created, "model": job.model, "choices": [],
                        "object": "chat.completion.chunk" if job.kind == "chat" else "text_completion",
                        "usage": _usage_dict(prompt, fold.completion, gen.cached_tokens)})
    pending.last = True
    yield pending


def _usage_dict(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": min(cached, prompt)}}


def _chunk(job: Job, index: int, delta: dict | None, finish: str | None, logprobs: dict | None = None, *,
           first: bool = False, usage: dict | None = None) -> dict:
    """One SSE chunk object of choice `index`: chat.completion.chunk (`delta`: the chat delta; the
    first chunk carries the role) or text_completion (`delta`: {"text": ...}). `usage`: the usage
    so far (continuous_usage_stats); otherwise null where include_usage asks for the key."""
    if job.kind == "chat":
        delta = {"role": "assistant", "content": ""} if first else (delta or {})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": (delta or {}).get("text") or "", "logprobs": logprobs,
                  "finish_reason": finish}
        obj = "text_completion"
    c = {"id": job.request_id, "object": obj, "created": job.created, "model": job.model, "choices": [choice]}
    if usage is not None or job.include_usage:
        c["usage"] = usage
    return c


def _sse(data: dict | str) -> bytes:
    return b"data: " + (data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))).encode() + b"\n\n"
