"""Record a real harness CLI's session through the gateway and save it as a trajectory fixture.

    npm install --prefix .harness @qwen-code/qwen-code @google/gemini-cli @openai/codex
    python scripts/record_session.py qwen-code gemini-cli codex

For each harness: an inference server with the scripted engine, Envoy and the gateway start on free
loopback ports (gateway/testing.py); the harness runs non-interactively as a subprocess with a private
HOME, its base URL pointed at Envoy's harness listener and the session key as its API key. The model
first answers with a Hermes `<tool_call>` for the harness's own shell tool, then (once a
`<tool_response>` is in the prompt) with a final message, so the session has at least two calls that
extend one another. The session's records are built into prefix_merging traces, verified, and written
to tests/fixtures/sessions/<harness>.json.zst. Request and response bodies are dropped from the file
(the checks use token ids, logprobs and finish reasons only) to keep it small.

Only 127.0.0.1 is contacted: every base URL names the gateway, no real key exists, telemetry and update
checks are off. The environment is built from scratch (no inherited proxy settings: Qwen Code sends even
loopback requests through an env proxy, ignoring NO_PROXY, and then fails with "fetch failed").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gateway.testing import running_gateway
from polar.trajectory import (
    build,
    session_trajectory,
    verify,
    views_from_protos,
    write_session,
)
from polar.v1 import common_pb2

ROOT = Path(__file__).resolve().parent.parent

HARNESS_BIN = ROOT / ".harness" / "node_modules" / ".bin"
FIXTURES = ROOT / "tests" / "fixtures" / "sessions"
MODEL = "polar-scripted"
PROMPT = "Create a file named hello.txt containing the word hello, using the shell."
FINAL = "Done: hello.txt now contains the word hello."


@dataclass(frozen=True)
class Harness:
    """How to run one harness CLI against the gateway."""

    binary: str
    tool_call: dict  # the Hermes tool call the model makes, in this harness's tool vocabulary
    setup: Callable[[Path, str, str], tuple[list[str], dict[str, str]]]  # (home, base_url, key) -> argv, env


def _qwen(home: Path, base_url: str, key: str) -> tuple[list[str], dict[str, str]]:
    settings = {
        "security": {"auth": {"selectedType": "openai"}},
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
    }
    _write_json(home / ".qwen" / "settings.json", settings)
    env = {"OPENAI_BASE_URL": base_url + "/v1", "OPENAI_API_KEY": key, "OPENAI_MODEL": MODEL}
    return [str(HARNESS_BIN / "qwen"), "--yolo", "--auth-type", "openai", "-m", MODEL, "-p", PROMPT], env


def _gemini(home: Path, base_url: str, key: str) -> tuple[list[str], dict[str, str]]:
    settings = {
        "security": {"auth": {"selectedType": "gemini-api-key"}},
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
        "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
    }
    _write_json(home / ".gemini" / "settings.json", settings)
    env = {
        "GOOGLE_GEMINI_BASE_URL": base_url,
        "GEMINI_API_KEY": key,
        # Gemini CLI exits 55 in a folder it has not been told to trust.
        "GEMINI_CLI_TRUST_WORKSPACE": "true",
    }
    return [str(HARNESS_BIN / "gemini"), "--yolo", "-m", MODEL, "-p", PROMPT], env


def _codex(home: Path, base_url: str, key: str) -> tuple[list[str], dict[str, str]]:
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    # Codex speaks only the Responses API; a custom provider points it at the gateway.
    (codex_home / "config.toml").write_text(
        f'model = "{MODEL}"\n'
        'model_provider = "polar"\n'
        "[model_providers.polar]\n"
        'name = "polar"\n'
        f'base_url = "{base_url}/v1"\n'
        'env_key = "POLAR_SESSION_KEY"\n'
        'wire_api = "responses"\n'
        "[analytics]\nenabled = false\n"
        "[otel]\nexporter = \"none\"\n"
    )
    env = {"CODEX_HOME": str(codex_home), "POLAR_SESSION_KEY": key}
    argv = [
        str(HARNESS_BIN / "codex"),
        "exec",
        "--skip-git-repo-check",
        "--dangerously-bypass-approvals-and-sandbox",
        PROMPT,
    ]
    return argv, env


SHELL_COMMAND = "echo hello > hello.txt"
HARNESSES = {
    "qwen-code": Harness("qwen", {"name": "run_shell_command", "arguments": {"command": SHELL_COMMAND}}, _qwen),
    "gemini-cli": Harness("gemini", {"name": "run_shell_command", "arguments": {"command": SHELL_COMMAND}}, _gemini),
    "codex": Harness("codex", {"name": "exec_command", "arguments": {"cmd": SHELL_COMMAND}}, _codex),
}


def _write_json(path: Path, value: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value))


def script_for(harness: Harness) -> dict:
    """Tool call first; the final message once a tool result is in the prompt (any later call too)."""
    call = "<tool_call>\n" + json.dumps(harness.tool_call) + "\n</tool_call>"
    return {
        "name": MODEL,
        "rules": [{"prompt_regex": "<tool_response>", "text": FINAL}],
        "outputs": [{"text": call}],
        "cycle": True,
    }


async def record(name: str, timeout: float, out_dir: Path, keep_bodies: bool) -> common_pb2.Trajectory:
    harness = HARNESSES[name]
    async with running_gateway(script_for(harness)) as gw:
        key = gw.open_session(task_id=f"record-{name}")
        with tempfile.TemporaryDirectory(prefix=f"polar-{name}-") as tmp:
            home, work = Path(tmp) / "home", Path(tmp) / "work"
            home.mkdir()
            work.mkdir()
            argv, harness_env = harness.setup(home, gw.base_url, key)
            env = {
                "PATH": os.environ.get("PATH", ""),
                "HOME": str(home),
                "TERM": "dumb",
                "NO_COLOR": "1",
                "CI": "1",
                **harness_env,
            }
            proc = await asyncio.create_subprocess_exec(
                *argv, cwd=work, env=env, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            )
            try:
                output, _ = await asyncio.wait_for(proc.communicate(), timeout)
            except TimeoutError:
                proc.kill()
                output, _ = await proc.communicate()
                print(f"{name}: timed out after {timeout:.0f}s", file=sys.stderr)
            print(f"--- {name} exited {proc.returncode}:\n{output.decode(errors='replace')[-4000:]}", file=sys.stderr)
            wrote = (work / "hello.txt").exists()
            print(f"{name}: tool ran (hello.txt written): {wrote}", file=sys.stderr)
        records = gw.records(key)
    if not keep_bodies:
        for r in records:
            r.ClearField("request_body")
            r.ClearField("response_body")
    if len(records) < 2:
        # A fixture is only worth keeping if the tool loop ran: one call per turn, at least two turns.
        raise SystemExit(f"{name}: recorded {len(records)} calls, expected at least 2; nothing written")
    calls = views_from_protos(records)
    result = build("prefix_merging", calls)
    report = verify(calls, result.traces)
    if not report.ok:
        raise SystemExit(f"{name}: traces do not verify:\n{report.render()}")
    trajectory = session_trajectory(records, result, key)
    path = out_dir / f"{name}.json.zst"
    write_session(path, trajectory)
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    print(
        f"{name}: {len(records)} calls, {len(trajectory.traces)} traces, "
        f"{trajectory.stats.chains} chains ({trajectory.stats.tokens_before} -> {trajectory.stats.tokens_after} "
        f"tokens); prompt tokens {[len(r.prompt_token_ids) for r in records]}, "
        f"sampled {[len(r.sampled_token_ids) for r in records]}, "
        f"finish {[common_pb2.FinishReason.Name(r.finish_reason) for r in records]}, "
        f"errors {[r.error for r in records if r.error]}; -> {shown} ({path.stat().st_size} bytes)",
        file=sys.stderr,
    )
    return trajectory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("harnesses", nargs="+", choices=sorted(HARNESSES))
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds a harness may run")
    parser.add_argument("--out", type=Path, default=FIXTURES, help="folder for the session files")
    parser.add_argument("--keep-bodies", action="store_true", help="keep request/response bodies (large)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.harnesses:
        asyncio.run(record(name, args.timeout, args.out, args.keep_bodies))


if __name__ == "__main__":
    main()
