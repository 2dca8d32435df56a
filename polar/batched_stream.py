"""Reading a stream ahead of its consumer, handing over what arrived in batches.

The gateway reads the inference server's token stream this way, and the inference server its engine's:
what an engine produced while the previous message was being sent goes out as one message.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Generic, TypeVar

T = TypeVar("T")


class StreamIdle(TimeoutError):
    """The stream sent nothing for `seconds`."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"the stream sent nothing for {seconds:g} s")
        self.seconds = seconds


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class ReadAhead(Generic[T]):
    """An async stream (a gRPC response stream, an engine's tokens) read in a task of its own,
    iterated as batches: everything that arrived since the last batch.

    Reading message by message makes each read a round trip through gRPC's completion queue, begun
    only once the previous message is handled; here the next read is in flight while the caller
    handles the current one, and messages that arrived meanwhile reach the caller together (one
    write to the client instead of one per message). Nothing is held back: a batch is what has
    arrived by the time the caller asks. The stream's error, if any, is raised after the messages
    that came before it.

    With `idle_timeout_s`, a stream that sends nothing for that long, while the caller waits for its
    next batch, raises `StreamIdle` (the caller then closes it): the wait is only counted while
    nothing has arrived, so the time the caller takes over a batch never counts against the stream.
    """

    def __init__(self, stream: AsyncIterator[T], idle_timeout_s: float | None = None) -> None:
        self._idle_timeout_s = idle_timeout_s
        self._arrived: list[T] = []
        self._ended = False
        self._error: BaseException | None = None
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[None] | None = None  # the caller's wait for the next arrival
        # One timer for the whole stream, not one per wait: a token stream waits once per message,
        # and asyncio.timeout's timer, set and cancelled each time, doubled the cost of a wait.
        # Each wait moves the deadline; the timer, when it fires, ends a wait past it or sets
        # itself for the deadline as it now stands.
        self._deadline = 0.0
        self._watchdog: asyncio.TimerHandle | None = None
        self._end_waiter: asyncio.Future[None] | None = None  # `until_ended`'s
        self._reader = asyncio.ensure_future(self._read(stream))

    async def _read(self, stream: AsyncIterator[T]) -> None:
        try:
            async for message in stream:
                self._arrived.append(message)
                self._wake()
        except Exception as exc:
            self._error = exc
        finally:
            self._ended = True
            self._wake()
            if self._end_waiter is not None:
                _resolve(self._end_waiter)
            self._stop_watchdog()  # nothing is left to wait for

    def _wake(self) -> None:
        if self._waiter is not None:
            _resolve(self._waiter)

    def __aiter__(self) -> AsyncIterator[list[T]]:
        return self._batches()

    async def _batches(self) -> AsyncIterator[list[T]]:
        while True:
            if not self._arrived and not self._ended:
                await self._next_arrival()
            batch, self._arrived = self._arrived, []
            if batch:
                yield batch
            elif self._ended:
                if self._error is not None:
                    raise self._error
                return

    async def _next_arrival(self) -> None:
        self._waiter = waiter = self._loop.create_future()
        if self._idle_timeout_s is not None:
            self._deadline = self._loop.time() + self._idle_timeout_s
            if self._watchdog is None:
                self._watchdog = self._loop.call_at(self._deadline, self._check_idle)
        try:
            await waiter
        finally:
            self._waiter = None

    async def until_ended(self, seconds: float) -> None:
        """Wait until the stream has ended or `seconds` have passed, whichever comes first; what
        arrives meanwhile is kept for the next batch."""
        if self._ended:
            return
        self._end_waiter = waiter = self._loop.create_future()
        timer = self._loop.call_later(seconds, _resolve, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._end_waiter = None

    def _check_idle(self) -> None:
        self._watchdog = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # nobody waits: the next wait sets the timer again
        if self._loop.time() >= self._deadline:
            waiter.set_exception(StreamIdle(self._idle_timeout_s))
        else:
            self._watchdog = self._loop.call_at(self._deadline, self._check_idle)

    def close(self) -> None:
        """Stop reading (the caller is done with the stream)."""
        self._reader.cancel()
        self._stop_watchdog()

    def _stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    async def aclose(self) -> None:
        """Stop reading and wait until the reader has let go of the stream, so that the stream may be
        closed now (an async generator cannot be closed while another task is inside it)."""
        self._reader.cancel()
        self._stop_watchdog()
        # wait, unlike awaiting the task, leaves the reader's cancellation out of this task: only a
        # cancellation of the caller itself ends the wait early.
        await asyncio.wait((self._reader,))
