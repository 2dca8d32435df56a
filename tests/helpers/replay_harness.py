"""A harness that replays a recorded session's requests, for the viewer's tests.

    python -m tests.helpers.replay_harness replay SESSION_FILE
        sends each recorded call's request body, as recorded, to the gateway in its dialect (the
        model's replies are the stack's, the requests the real CLI's)
    python -m tests.helpers.replay_harness hostile
        one Chat Completions conversation whose prompt and tool result hold markup that would run
        as script

It reads the environment a node gives every harness (POLAR_BASE_URL, POLAR_SESSION_KEY).
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request

from polar.trajectory.session_file import read_trajectory
from polar.v1 import common_pb2

HOSTILE = '<script>window.__polar_pwned = 1</script><img src=x onerror="window.__polar_pwned = 2">'


def post(path: str, body: bytes) -> None:
    key = os.environ["POLAR_SESSION_KEY"]
    request = urllib.request.Request(
        os.environ["POLAR_BASE_URL"] + path,
        data=body,
        headers={
            "Content-Type": "application/json",
            "Authorization": f"Bearer {key}",
            "x-api-key": key,
            "x-goog-api-key": key,
            "anthropic-version": "2023-06-01",
        },
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()


def path_of(call: common_pb2.CallRecord) -> str:
    if call.dialect == common_pb2.DIALECT_OPENAI_CHAT:
        return "/v1/chat/completions"
    if call.dialect == common_pb2.DIALECT_OPENAI_RESPONSES:
        return "/v1/responses"
    if call.dialect == common_pb2.DIALECT_ANTHROPIC_MESSAGES:
        return "/v1/messages"
    method = "streamGenerateContent?alt=sse" if call.stream else "generateContent"
    return f"/v1beta/models/{call.model or 'polar'}:{method}"


def replay(file: str) -> None:
    for call in read_trajectory(file).calls:
        post(path_of(call), call.request_body)


def hostile() -> None:
    messages = [
        {"role": "system", "content": "You are a test. " + HOSTILE},
        {"role": "user", "content": "Say " + HOSTILE},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "bash", "arguments": json.dumps({"command": HOSTILE})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "tool says " + HOSTILE},
    ]
    post("/v1/chat/completions", json.dumps({"model": "polar", "messages": messages}).encode())


if __name__ == "__main__":
    if sys.argv[1] == "replay":
        replay(sys.argv[2])
    else:
        hostile()
