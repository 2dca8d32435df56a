"""A hand-written HTTP/1.1 client on asyncio, for the gateway benchmarks' load: requests encoded once
up front, replies read whole without parsing their JSON (the status and the body, chunk framing left
in), so that the client costs far less CPU per request than the servers it loads.
"""

from __future__ import annotations

import asyncio
import json


def http_request(address: str, path: str, headers: dict[str, str], body: dict) -> bytes:
    """A POST of `body` as JSON to `path` on `address`, encoded whole, with these extra headers."""
    # Written as the harnesses write JSON (Node's JSON.stringify, serde_json): compact, characters
    # past ASCII as UTF-8. A recorded body read and written back is the body its harness sent.
    data = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {address}",
        "Content-Type: application/json",
        f"Content-Length: {len(data)}",
    ]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


class HttpConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; `request` sends pre-encoded bytes and waits for the whole
    reply (Content-Length or chunked), returning its status and body (chunk framing left in)."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._waiter: asyncio.Future[tuple[int, bytes]] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if self._waiter is None or self._waiter.done():
            return
        end = _response_end(self._buffer)
        if end:
            status = int(self._buffer[9:12])
            head_end = self._buffer.find(b"\r\n\r\n") + 4
            self._waiter.set_result((status, bytes(self._buffer[head_end:end])))
            del self._buffer[:end]

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(ConnectionError(f"the server closed the connection ({exc})"))

    async def request(self, payload: bytes) -> tuple[int, bytes]:
        if self._transport is None:
            raise ConnectionError("not connected")
        self._waiter = asyncio.get_running_loop().create_future()
        self._transport.write(payload)
        return await self._waiter

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


def _response_end(buffer: bytearray) -> int:
    """The length of the first complete HTTP response in buffer, or 0 while it is incomplete."""
    head_end = buffer.find(b"\r\n\r\n")
    if head_end < 0:
        return 0
    head = bytes(buffer[:head_end]).lower()
    body = head_end + 4
    length_at = head.find(b"\r\ncontent-length:")
    if length_at >= 0:
        value_end = head.find(b"\r\n", length_at + 2)
        end = body + int(head[length_at + 17 : value_end if value_end >= 0 else len(head)])
        return end if len(buffer) >= end else 0
    if b"\r\ntransfer-encoding: chunked" not in head:
        raise ConnectionError(f"a reply with neither Content-Length nor chunked encoding: {head[:200]!r}")
    position = body
    while True:
        line_end = buffer.find(b"\r\n", position)
        if line_end < 0:
            return 0
        size = int(bytes(buffer[position:line_end]).split(b";")[0], 16)
        if size == 0:
            end = line_end + 4  # "0\r\n" and the empty trailer line
            return end if len(buffer) >= end else 0
        position = line_end + 2 + size + 2


def send_once(address: str, payload: bytes) -> tuple[int, bytes]:
    """One request on a connection of its own: the reply's status and body."""

    async def send() -> tuple[int, bytes]:
        host, _, port = address.rpartition(":")
        _, connection = await asyncio.get_running_loop().create_connection(HttpConnection, host, int(port))
        try:
            return await asyncio.wait_for(connection.request(payload), 30.0)
        finally:
            connection.close()

    return asyncio.run(send())
