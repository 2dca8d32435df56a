"""A minimal agent on the OpenAI SDK's Chat Completions API (see agent_tools.py)."""

from __future__ import annotations

import json
import os
import sys

import openai
from agent_tools import MAX_TURNS, TOOLS, instruction, model, run_tool


def main() -> int:
    client = openai.OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"])
    tools = [{"type": "function", "function": tool} for tool in TOOLS]
    messages: list[dict] = [{"role": "user", "content": instruction()}]
    for _ in range(MAX_TURNS):
        message = client.chat.completions.create(model=model(), messages=messages, tools=tools).choices[0].message
        if not message.tool_calls:
            print(message.content)
            return 0
        calls = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
            for call in message.tool_calls
        ]
        messages.append({"role": "assistant", "content": message.content, "tool_calls": calls})
        for call in message.tool_calls:
            result = run_tool(call.function.name, json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    print(f"no final answer after {MAX_TURNS} calls", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
