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

Aborts: a request whose iteration is left early (break, cancellation, aclose) is aborted at the
next command drain, i.e. before the next step, whatever it is doing (waiting for a seat, mid
prefill, decoding); its KV blocks and seat are free from then on. `abort(request_id)` returns the
abort's report: a future of the request's final output as the engine made it (how many prompt
tokens it computed: billing counts them), or None when the engine no longer held it. A request
that finished in the step during which its stream was closed reports that final output instead
(it was computed in full). Reports of the last `ABORT_REPORTS_KEPT` aborts stay available, so a
caller that closes a stream can ask for its report afterwards.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
from collections import OrderedDict
from typing import AsyncIterator

from engine import metrics as engine_metrics
from engine import omp_threads
from engine.llm_engine import STALL_WAIT_S, LLMEngine
from engine.sampling_params import GenerationRequest, InvalidRequestError, RequestOutput

log = logging.getLogger(__name__)

#: Engine states: serving; reset in progress after the step loop died; resets keep failing;
#: shut down.
READY, RESTARTING, FAILED, STOPPED = "ready", "restarting", "failed", "stopped"
RESET_BACKOFF_S = (0.1, 30.0)  # first and longest wait between failed resets
FAILED_AFTER_ATTEMPTS = 5
#: Abort reports kept for callers that ask after the stream closed (the gateway asks at once).
ABORT_REPORTS_KEPT = 1024


class EngineDeadError(RuntimeError):
    """The engine's step loop is not serving (it died, is restarting, or was shut down)."""


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # request id -> (its event loop, its delta queue, the future that accepts it)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, asyncio.Future]] = {}
        # request id -> the report of its abort (`abort`), the latest ABORT_REPORTS_KEPT (callers
        # on several event loops' threads share it: under the lock)
        self._aborts: OrderedDict[str, concurrent.futures.Future] = OrderedDict()
        self._aborts_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._state = READY
        #: Times the step loop died and was restarted.
        self.restarts = 0
        #: The exception type that last ended the step loop (None if it never died); only the type,
        #: so health endpoints carry no paths or data from the message (the log has it whole).
        self.last_error: str | None = None
        # The engine was built (and warmed up) on this thread; from now on it steps on its own:
        # this thread's OpenMP workers would only slow the step's regions (engine.omp_threads).
        omp_threads.release_pool()
        if engine.lora_manager is not None:
            engine.lora_manager.load_listeners.append(self._wake.set)
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
        aborts the request in the engine before its next step, which frees its KV blocks and
        seat; `abort(request_id)` then gives the abort's report.
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
        with self._aborts_lock:
            self._aborts.pop(request.request_id, None)  # a report of an earlier request with this id
        self._streams[request.request_id] = (loop, q, accepted)
        self._commands.put(("add", request, loop, accepted))
        self._wake.set()
        finished = False
        try:
            try:
                await accepted  # raises InvalidRequestError (or EngineDeadError) from the engine thread
            except (InvalidRequestError, EngineDeadError):
                finished = True  # never queued (or dropped by a reset): nothing to abort
                raise
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if finished or request.request_id in self._aborts:  # ended, or `abort` was called already
                self._streams.pop(request.request_id, None)
            else:
                # The stream stays registered until the abort is done: a final output the engine
                # made meanwhile lands in `q`, where the report finds it.
                self._abort(request.request_id, (loop, q))

    def abort(self, request_id: str) -> concurrent.futures.Future:
        """Abort a request before the engine's next step (its KV blocks and seat are freed then).
        Returns the abort's report (module docstring): a future of the request's final output
        (finish_reason "abort", `computed_prompt_tokens`), or of None when the engine does not
        hold the request (unknown, or finished before with its final output already consumed).
        Aborting the same request again returns the same report. Call it on an event loop's
        thread; await the report with asyncio.wrap_future."""
        return self._abort(request_id, None)

    def _abort(self, request_id: str, closed: tuple[asyncio.AbstractEventLoop, asyncio.Queue] | None):
        """`abort`; `closed`: the loop and delta queue of the request's stream, which its iteration
        has left (the report then looks in the queue for a final output made meanwhile)."""
        with self._aborts_lock:
            report = self._aborts.get(request_id)
            if report is not None:
                return report
            report = concurrent.futures.Future()
            self._aborts[request_id] = report
            while len(self._aborts) > ABORT_REPORTS_KEPT:
                self._aborts.popitem(last=False)
        self._commands.put(("abort", request_id, report, closed))
        self._wake.set()
        return report

    def _settle_abort(self, request_id: str, report: concurrent.futures.Future, out: RequestOutput | None,
                      q: asyncio.Queue) -> None:
        """On the closed stream's loop, after every delta the engine made for it was queued: the
        report is the abort's final output, or the final output the request finished with before
        the abort came (unread in `q`), or None."""
        entry = self._streams.get(request_id)
        if entry is not None and entry[1] is q:
            del self._streams[request_id]
        while out is None and not q.empty():
            item = q.get_nowait()
            if isinstance(item, RequestOutput) and item.finished:
                out = item
        _resolve(report, out)

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
            _on_loop(loop, q.put_nowait, item)

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
                _, request_id, report, closed = cmd
                out = self.engine.abort(request_id)
                if closed is None:
                    if out is not None:
                        self._deliver(request_id, out)  # a stream still read ends with it
                    _resolve(report, out)
                else:
                    loop, q = closed
                    if not _on_loop(loop, self._settle_abort, request_id, report, out, q):
                        self._streams.pop(request_id, None)  # its loop has ended: nobody reads `q`
                        _resolve(report, out)

    def _loop(self) -> None:
        while not self._stopped.is_set():
            self._drain_commands()
            if not self.engine.has_unfinished():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            for out in self.engine.step():
                self._deliver(out.request_id, out)
            if self.engine.stalled:  # its requests wait for adapter loads (which wake it) or room
                self._wake.wait(timeout=STALL_WAIT_S)
                self._wake.clear()

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
            elif cmd[0] == "abort":
                _, request_id, report, closed = cmd
                if closed is not None:
                    self._streams.pop(request_id, None)
                _resolve(report, None)  # the reset drops the request; what it computed is unknown
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


def _on_loop(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    """Call fn(*args) on `loop` soon; False if the loop has closed (its caller is gone)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        return False
    return True


def _resolve(report: concurrent.futures.Future, out: RequestOutput | None) -> None:
    if not report.done():
        report.set_result(out)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
