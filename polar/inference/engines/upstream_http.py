"""The upstream engine's HTTP side: one client per upstream (TCP or a Unix socket, the engine's
timeouts), JSON calls whose error statuses become `UpstreamRefused` with the body's message, and the
JSON events of a server-sent event stream (or the one body of a reply that is not streamed)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp

_ERROR_TEXT_LIMIT = 300


class UpstreamError(RuntimeError):
    """The upstream cannot serve as this engine: unreachable, refusing, or with another tokenizer.
    The message names the upstream and says what differs."""


class UpstreamRefused(Exception):
    """The upstream answered a request with an error status; `status` and its body's message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class UpstreamHttp:
    """The engine's HTTP client of one upstream: JSON calls and event streams, with the engine's timeouts."""

    def __init__(self, base: str, served_model: str, timeout_s: float) -> None:
        self.base = base.rstrip("/")
        # "unix:PATH": a server listening on a Unix socket (vLLM's --uds); requests name any host.
        self._socket = self.base[len("unix:") :] if self.base.startswith("unix:") else ""
        self._root = "http://localhost" if self._socket else self.base
        self.served_model = served_model
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # Generations run at once as the gateway asks: no pool limit of our own.
            connector = (
                aiohttp.UnixConnector(path=self._socket, limit=0) if self._socket else aiohttp.TCPConnector(limit=0)
            )
            self._session = aiohttp.ClientSession(timeout=self._timeout, connector=connector)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def get_json(self, path: str) -> Any:
        async with self.session.get(self._root + path) as response:
            return await json_or_refusal(response)

    async def post_json(self, path: str, body: Mapping[str, Any]) -> Any:
        async with self.session.post(self._root + path, json=body) as response:
            return await json_or_refusal(response)

    async def post_for_text(self, path: str, body: Mapping[str, Any]) -> str:
        """A JSON call whose success is answered in plain text (vLLM's adapter routes)."""
        async with self.session.post(self._root + path, json=body) as response:
            text = await response.text()
            if response.status >= 400:
                raise UpstreamRefused(response.status, error_message(text))
            return text

    def post(self, path: str, body: Mapping[str, Any]):
        return self.session.post(self._root + path, json=body)


async def json_or_refusal(response) -> Any:
    text = await response.text()
    if response.status >= 400:
        raise UpstreamRefused(response.status, error_message(text))
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise UpstreamRefused(response.status, f"not JSON: {text[:_ERROR_TEXT_LIMIT]!r}") from None


def error_message(text: str) -> str:
    """The message of an upstream's error body (OpenAI's {"error": {"message"}}, FastAPI's
    {"detail"}, SGLang's {"error": {...}} or {"message"}), else its first characters."""
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return text[:_ERROR_TEXT_LIMIT].strip() or "(empty body)"
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict):
            for key in ("message", "detail"):
                if error.get(key):
                    return str(error[key])[:_ERROR_TEXT_LIMIT]
        elif isinstance(error, str):
            return error[:_ERROR_TEXT_LIMIT]
        if body.get("detail"):
            return str(body["detail"])[:_ERROR_TEXT_LIMIT]
    return text[:_ERROR_TEXT_LIMIT]


async def events(response) -> AsyncIterator[dict[str, Any]]:
    """The JSON payloads of a server-sent event stream, up to `data: [DONE]` or its end."""
    async for raw in response.content:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            return
        event = json.loads(payload)
        if isinstance(event, dict) and "error" in event and not event.get("choices") and not event.get("meta_info"):
            raise UpstreamRefused(200, error_message(payload))
        yield event


async def whole_body(response) -> AsyncIterator[dict[str, Any]]:
    """A reply that is not streamed: its one JSON body, as the only event."""
    body = json.loads(await response.text())
    if not isinstance(body, dict):
        raise ValueError(f"the reply is a JSON {type(body).__name__}, not an object")
    yield body
