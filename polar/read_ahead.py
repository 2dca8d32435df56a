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
        self._wakeup = asyncio.Event()
        self._reader = asyncio.ensure_future(self._read(stream))

    async def _read(self, stream: AsyncIterator[T]) -> None:
        try:
            async for message in stream:
                self._arrived.append(message)
                self._wakeup.set()
        except Exception as exc:  # noqa: BLE001 - handed to the caller, in order
            self._error = exc
        finally:
            self._ended = True
            self._wakeup.set()

    def __aiter__(self) -> AsyncIterator[list[T]]:
        return self._batches()

    async def _batches(self) -> AsyncIterator[list[T]]:
        while True:
            if not self._arrived and not self._ended:
                await self._next_arrival()
            self._wakeup.clear()
            batch, self._arrived = self._arrived, []
            if batch:
                yield batch
            elif self._ended:
                if self._error is not None:
                    raise self._error
                return

    async def _next_arrival(self) -> None:
        if self._idle_timeout_s is None:
            await self._wakeup.wait()
            return
        try:
            async with asyncio.timeout(self._idle_timeout_s):
                await self._wakeup.wait()
        except TimeoutError:
            raise StreamIdle(self._idle_timeout_s) from None

    def close(self) -> None:
        """Stop reading (the caller is done with the stream)."""
        self._reader.cancel()

    async def aclose(self) -> None:
        """Stop reading and wait until the reader has let go of the stream, so that the stream may be
        closed now (an async generator cannot be closed while another task is inside it)."""
        self._reader.cancel()
        # wait, unlike awaiting the task, leaves the reader's cancellation out of this task: only a
        # cancellation of the caller itself ends the wait early.
        await asyncio.wait((self._reader,))
