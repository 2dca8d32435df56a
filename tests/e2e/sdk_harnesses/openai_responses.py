"""A minimal agent on the OpenAI SDK's Responses API, stateless (the whole input each call; see agent_tools.py)."""

from __future__ import annotations

import json
import os
import sys

import openai
from agent_tools import MAX_TURNS, TOOLS, instruction, model, run_tool


def main() -> int:
    client = openai.OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"])
    tools = [{"type": "function", **tool} for tool in TOOLS]
    items: list[dict] = [{"role": "user", "content": instruction()}]
    for _ in range(MAX_TURNS):
        response = client.responses.create(model=model(), input=items, tools=tools, store=False)
        calls = [item for item in response.output if item.type == "function_call"]
        if not calls:
            print(response.output_text)
            return 0
        items += [item.model_dump(exclude_none=True) for item in response.output]
        for call in calls:
            result = run_tool(call.name, json.loads(call.arguments))
            items.append({"type": "function_call_output", "call_id": call.call_id, "output": result})
    print(f"no final answer after {MAX_TURNS} calls", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
