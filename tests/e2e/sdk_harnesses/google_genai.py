"""A minimal agent on the google-genai SDK's generateContent (see agent_tools.py); the SDK's automatic
function calling is off, so each call and result crosses the wire as the model's own turn."""

from __future__ import annotations

import os
import sys

from agent_tools import MAX_TURNS, TOOLS, instruction, model, run_tool
from google import genai
from google.genai import types


def main() -> int:
    client = genai.Client(
        api_key=os.environ["GEMINI_API_KEY"],
        http_options=types.HttpOptions(base_url=os.environ["GOOGLE_GEMINI_BASE_URL"]),
    )
    declarations = [
        types.FunctionDeclaration(name=t["name"], description=t["description"], parameters_json_schema=t["parameters"])
        for t in TOOLS
    ]
    config = types.GenerateContentConfig(
        tools=[types.Tool(function_declarations=declarations)],
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
    )
    contents = [types.Content(role="user", parts=[types.Part.from_text(text=instruction())])]
    for _ in range(MAX_TURNS):
        response = client.models.generate_content(model=model(), contents=contents, config=config)
        calls = response.function_calls or []
        if not calls:
            print(response.text)
            return 0
        contents.append(response.candidates[0].content)
        results = [
            types.Part.from_function_response(name=call.name, response={"result": run_tool(call.name, dict(call.args))})
            for call in calls
        ]
        contents.append(types.Content(role="user", parts=results))
    print(f"no final answer after {MAX_TURNS} calls", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
