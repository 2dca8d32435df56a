"""The example agent's model call: a busy moment (429, 502, 503, 504) is tried again, as the SDKs do."""

from __future__ import annotations

import json
import threading
import urllib.error
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.helpers.example_modules import example_module

agent = example_module("agent/agent.py")
REPLY = {"choices": [{"message": {"role": "assistant", "content": "done"}}]}


def _serve(statuses: list[int]) -> tuple[ThreadingHTTPServer, list[int]]:
    """A server answering each POST with the next status of `statuses` (200: REPLY); the calls made."""
    calls: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            status = statuses[len(calls)]
            calls.append(status)
            body = json.dumps(REPLY if status == 200 else {"error": "busy"}).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, calls


@pytest.fixture
def environment(monkeypatch):
    monkeypatch.setattr(agent, "RETRY_DELAYS_S", (0.01, 0.01))
    monkeypatch.setenv("OPENAI_API_KEY", "key")
    monkeypatch.setenv("POLAR_MODEL", "tiny")
    return monkeypatch


def _chat_against(environment, statuses: list[int]):
    server, calls = _serve(statuses)
    environment.setenv("OPENAI_BASE_URL", f"http://127.0.0.1:{server.server_address[1]}/v1")
    try:
        return agent.chat([{"role": "user", "content": "hi"}]), calls
    finally:
        server.shutdown()


def test_a_busy_answer_is_tried_again_until_the_reply_comes(environment) -> None:
    message, calls = _chat_against(environment, [503, 429, 200])
    assert (message, calls) == (REPLY["choices"][0]["message"], [503, 429, 200])


def test_the_agent_gives_up_after_three_busy_answers(environment) -> None:
    with pytest.raises(urllib.error.HTTPError, match="502"):
        _chat_against(environment, [503, 504, 502, 200])


def test_a_refusal_is_not_tried_again(environment) -> None:
    server, calls = _serve([400, 200])
    environment.setenv("OPENAI_BASE_URL", f"http://127.0.0.1:{server.server_address[1]}/v1")
    try:
        with pytest.raises(urllib.error.HTTPError, match="400"):
            agent.chat([{"role": "user", "content": "hi"}])
    finally:
        server.shutdown()
    assert calls == [400]
