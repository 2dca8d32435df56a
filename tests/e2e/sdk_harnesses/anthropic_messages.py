"""A minimal agent on the Anthropic SDK's Messages API (see agent_tools.py)."""

from __future__ import annotations

import os
import sys

import anthropic
from agent_tools import MAX_TURNS, TOOLS, instruction, model, run_tool

MAX_TOKENS = 1024


def main() -> int:
    client = anthropic.Anthropic(base_url=os.environ["ANTHROPIC_BASE_URL"], api_key=os.environ["ANTHROPIC_API_KEY"])
    tools = [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]} for t in TOOLS]
    messages: list[dict] = [{"role": "user", "content": instruction()}]
    for _ in range(MAX_TURNS):
        response = client.messages.create(model=model(), max_tokens=MAX_TOKENS, messages=messages, tools=tools)
        uses = [block for block in response.content if block.type == "tool_use"]
        if not uses:
            print("".join(block.text for block in response.content if block.type == "text"))
            return 0
        messages.append(
            {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in response.content]}
        )
        results = [
            {"type": "tool_result", "tool_use_id": use.id, "content": run_tool(use.name, use.input)} for use in uses
        ]
        messages.append({"role": "user", "content": results})
    print(f"no final answer after {MAX_TURNS} calls", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
