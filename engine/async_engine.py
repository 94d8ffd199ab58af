"""Async API over LLMEngine: `generate(request)` yields deltas; the step loop runs in a thread.

The engine's step loop runs on one background thread so the asyncio event loop never blocks on
model compute. Requests and aborts cross into that thread through a command queue; deltas come
back through `loop.call_soon_threadsafe` into one asyncio.Queue per request.

Supervision: the same thread supervises the loop. A fault the engine cannot trace to a request
or adapter (LLMEngine.step raises: a bug, out of memory) ends the loop; then every request in
flight gets EngineDeadError at once (the gateway answers 503 and bills what was sent), the state
becomes "restarting", `LLMEngine.reset()` drops every request (weights and KV tensors are kept)
and the loop starts again, serving new requests without a process restart. A reset that raises
is retried with exponential backoff; after `FAILED_AFTER_ATTEMPTS` failed resets in a row the
state reads "failed" (retries go on at the longest backoff).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from typing import AsyncIterator

from engine import metrics as engine_metrics
from engine.llm_engine import LLMEngine
from engine.sampling_params import GenerationRequest, InvalidRequestError, RequestOutput

log = logging.getLogger(__name__)

#: Engine states: serving; reset in progress after the step loop died; resets keep failing;
#: shut down.
READY, RESTARTING, FAILED, STOPPED = "ready", "restarting", "failed", "stopped"
RESET_BACKOFF_S = (0.1, 30.0)  # first and longest wait between failed resets
FAILED_AFTER_ATTEMPTS = 5


class EngineDeadError(RuntimeError):
    """The engine's step loop is not serving (it died, is restarting, or was shut down)."""


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # request id -> (its event loop, its delta queue, the future that accepts it)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, asyncio.Future]] = {}
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._state = READY
        #: Times the step loop died and was restarted.
        self.restarts = 0
        #: The exception type that last ended the step loop (None if it never died); only the type,
        #: so health endpoints carry no paths or data from the message (the log has it whole).
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._supervise, name="tessera-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def state(self) -> str:
        """"ready" (serving), "restarting", "failed" (resets keep failing) or "stopped"."""
        if self._state == READY and not self._thread.is_alive():
            return STOPPED
        return self._state

    @property
    def is_alive(self) -> bool:
        """Whether the engine serves requests now (state "ready")."""
        return self.state == READY

    def health(self) -> dict:
        """The engine's state for health and readiness endpoints (no tenant data)."""
        return {"state": self.state, "restarts": self.restarts, "last_error": self.last_error}

    # -- public API ---------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Yield the request's deltas; the last has `finished` set and exact token counts.

        Raises InvalidRequestError before yielding anything if the request is refused, and
        EngineDeadError when the engine is not ready or its step loop dies while the request is
        in flight. Leaving the iteration early (break, task cancellation, client disconnect)
        aborts the request in the engine, which frees its KV blocks.
        """
        state = self.state
        if state != READY:
            raise EngineDeadError(f"the engine is {state}")
        loop = asyncio.get_running_loop()
        if request.params.response_format is not None and request.grammar is None:
            # Compiling takes milliseconds: on a worker thread, so the step loop never compiles.
            grammar = await loop.run_in_executor(None, self.engine.structured.compile, request.params.response_format)
            request = dataclasses.replace(request, grammar=grammar)
        q: asyncio.Queue = asyncio.Queue()
        accepted: asyncio.Future = loop.create_future()
        self._streams[request.request_id] = (loop, q, accepted)
        self._commands.put(("add", request, loop, accepted))
        self._wake.set()
        finished = False
        try:
            await accepted  # raises InvalidRequestError (or EngineDeadError) from the engine thread
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request.request_id, None)
            if not finished:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already finished)."""
        self._commands.put(("abort", request_id))
        self._wake.set()

    def shutdown(self) -> None:
        self._stopped.set()
        self._wake.set()
        self._thread.join(timeout=10)
        self._state = STOPPED

    # -- engine thread ------------------------------------------------------------------------

    def _deliver(self, request_id: str, item) -> None:
        entry = self._streams.get(request_id)
        if entry is not None:
            loop, q, _ = entry
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _queued_commands(self):
        """Yield the commands queued for the engine thread, one at a time, until none is left."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            yield cmd

    def _drain_commands(self) -> None:
        for cmd in self._queued_commands():
            if cmd[0] == "add":
                _, request, loop, fut = cmd
                try:
                    self.engine.add_request(request)
                except InvalidRequestError as e:
                    loop.call_soon_threadsafe(_set_exception, fut, e)
                    continue
                except Exception as e:  # noqa: BLE001 - report any refusal to the caller
                    loop.call_soon_threadsafe(_set_exception, fut, InvalidRequestError(str(e)))
                    continue
                loop.call_soon_threadsafe(_set_result, fut, None)
            elif cmd[0] == "abort":
                out = self.engine.abort(cmd[1])
                if out is not None:
                    self._deliver(cmd[1], out)

    def _loop(self) -> None:
        while not self._stopped.is_set():
            self._drain_commands()
            if not self.engine.has_unfinished():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            for out in self.engine.step():
                self._deliver(out.request_id, out)

    def _supervise(self) -> None:
        while not self._stopped.is_set():
            try:
                self._loop()
                return
            except BaseException as e:  # noqa: BLE001 - a dead loop must fail every waiter, then restart
                log.exception("engine step loop died; resetting the engine")
                self._state = RESTARTING
                self.last_error = type(e).__name__
                self._fail_in_flight(EngineDeadError(f"the engine failed and is restarting ({type(e).__name__})"))
            if not self._reset():
                return  # shut down while resetting
            self.restarts += 1
            engine_metrics.RESTARTS.inc()
            self._state = READY
            log.warning("engine step loop restarted (restart %d)", self.restarts)

    def _fail_in_flight(self, err: EngineDeadError) -> None:
        """Every request in flight, accepted or still queued as a command, gets `err` now."""
        for cmd in self._queued_commands():
            if cmd[0] == "add":
                _, _, loop, fut = cmd
                loop.call_soon_threadsafe(_set_exception, fut, err)
        for rid in list(self._streams):
            entry = self._streams.get(rid)
            if entry is not None:
                loop, q, fut = entry
                loop.call_soon_threadsafe(_set_exception, fut, err)
                loop.call_soon_threadsafe(q.put_nowait, err)

    def _reset(self) -> bool:
        """Reset the engine, retrying with backoff; False if shut down meanwhile."""
        delay, attempts = RESET_BACKOFF_S[0], 0
        while not self._stopped.is_set():
            try:
                self.engine.reset()
                return True
            except Exception:  # noqa: BLE001 - retried; the state says it is failing
                attempts += 1
                log.exception("engine reset failed (attempt %d); retrying in %.1f s", attempts, delay)
                if attempts >= FAILED_AFTER_ATTEMPTS:
                    self._state = FAILED
            self._stopped.wait(delay)
            delay = min(delay * 2, RESET_BACKOFF_S[1])
        return False


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
