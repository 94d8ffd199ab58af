"""Async API over LLMEngine: `generate(request)` yields deltas; the step loop runs in a thread.

The engine's step loop runs on one background thread so the asyncio event loop never blocks on
model compute. Requests and aborts cross into that thread through a command queue; deltas come
back through `loop.call_soon_threadsafe` into one asyncio.Queue per request.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import AsyncIterator

from engine.llm_engine import LLMEngine
from engine.sampling_params import GenerationRequest, InvalidRequestError, RequestOutput

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine's step loop has stopped; no request can be served."""


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tessera-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    # -- public API ---------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Yield the request's deltas; the last has `finished` set and exact token counts.

        Raises InvalidRequestError before yielding anything if the request is refused. Leaving
        the iteration early (break, task cancellation, client disconnect) aborts the request in
        the engine, which frees its KV blocks.
        """
        if not self.is_alive:
            raise EngineDeadError("engine is not running")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        accepted: asyncio.Future = loop.create_future()
        self._streams[request.request_id] = (loop, q)
        self._commands.put(("add", request, loop, accepted))
        self._wake.set()
        finished = False
        try:
            await accepted  # raises InvalidRequestError from the engine thread
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

    # -- engine thread ------------------------------------------------------------------------

    def _deliver(self, request_id: str, item) -> None:
        entry = self._streams.get(request_id)
        if entry is not None:
            loop, q = entry
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
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

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                self._drain_commands()
                if not self.engine.has_unfinished():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
        except BaseException as e:  # noqa: BLE001 - a dead engine must fail every waiter
            log.exception("engine step loop died")
            self._dead = e
            err = EngineDeadError(f"engine failed: {e}")
            for rid in list(self._streams):
                self._deliver(rid, err)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
