"""Client disconnects: a streaming response that stops its producer the moment the client goes
away, and `cancel_on_disconnect` for work whose answer is sent only at the end.

Starlette's StreamingResponse only notices a disconnect when a write fails, which some servers
never report; this one listens for `http.disconnect` next to the producer and cancels it, then
closes the body iterator (shielded), so the producer's cleanup (aborting the engine request,
recording usage) always runs.
"""
from __future__ import annotations

from typing import AsyncIterator, Awaitable, Callable, TypeVar

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class Final(bytes):
    """A body's last chunk: DisconnectAwareStream sends it together with the end of the body (one
    socket write, so the client has the whole answer one wake-up sooner)."""


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready."""


async def cancel_on_disconnect(receive: Receive, work: Callable[[], Awaitable[T]]) -> T:
    """Run `work()` while listening for `http.disconnect` (the request body must already be
    read). If the client leaves first, `work` is cancelled (its cleanup sees the cancellation,
    e.g. to abort the engine request) and ClientDisconnected is raised. Starlette does not cancel
    a plain (non-streaming) endpoint when its client disconnects, so without this a long
    generation nobody will read runs to the end and is billed as completed. An exception `work`
    raises reaches the caller as itself, not wrapped in the task group's exception group."""
    result: list[T] = []
    left = False

    async def watch(cancel: anyio.CancelScope) -> None:
        nonlocal left
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                left = True
                cancel.cancel()
                return

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch, tg.cancel_scope)
            result.append(await work())
            tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
    if left and not result:
        raise ClientDisconnected()
    return result[0]


_END = object()


class DisconnectAwareStream(Response):
    """Send each bytes chunk of `body` as soon as it is produced (no buffering). A `Final` chunk
    ends the body; the iterator is still run to its end (its cleanup), but nothing after a Final
    chunk is sent. The body is started (its first chunk asked for) before anything is sent: a
    generator closed before it started would never run its cleanup, so a client gone before the
    headers went out would leave the engine request running and the usage unrecorded."""

    def __init__(self, body: AsyncIterator[bytes], *, media_type: str, headers: dict[str, str] | None = None,
                 status_code: int = 200):
        self.body_iterator = body
        self.status_code = status_code
        self.media_type = media_type
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def watch_disconnect(cancel: anyio.CancelScope) -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    cancel.cancel()
                    return

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch_disconnect, tg.cancel_scope)
                chunk = await anext(self.body_iterator, _END)
                await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
                ended = False
                while chunk is not _END:
                    if not ended:
                        ended = isinstance(chunk, Final)
                        await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
                    chunk = await anext(self.body_iterator, _END)
                if not ended:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                tg.cancel_scope.cancel()
        except OSError:
            pass  # the client went away while we were writing; cleanup below
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
