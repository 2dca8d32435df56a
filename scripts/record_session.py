"""Record a real harness CLI's session through the gateway and save it as a trajectory fixture.

    npm ci --prefix tests/e2e/harness_install
    python scripts/record_session.py codex claude-code qwen-code gemini-cli pi

For each harness: an inference server with the scripted engine, Envoy and the gateway start on free
loopback ports (polar/testing/gateway.py); the harness CLI runs as its preset launches it
(polar/rollout/harness.py: headless flags, config files in a private HOME, every base URL pointed at
Envoy's harness listener and every key variable holding the session key). The model first answers
with a Hermes `<tool_call>` for the harness's own shell tool, then (once a
`<tool_response>` is in the prompt) with a final message, so the session has at least two calls that
extend one another. The session's records are built into prefix_merging traces, verified, and written
to tests/fixtures/sessions/<harness>.json.zst. Request bodies stay (scripts/bench_gateway_replay.py replays them
as load); response bodies are dropped from the file (the checks use token ids, logprobs and finish
reasons only) to keep it small.

Only 127.0.0.1 is contacted: every base URL names the gateway, no real key exists, telemetry and update
checks are off, and the environment is built from scratch (no inherited proxy settings).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

from polar.rollout.harness import PRESETS, HarnessContext, Preset, prepare_launch
from polar.testing.gateway import running_gateway
from polar.trajectory import (
    build,
    session_trajectory,
    verify,
    views_from_protos,
    write_session,
)
from polar.v1 import common_pb2, rollout_pb2

ROOT = Path(__file__).resolve().parent.parent

HARNESS_BIN = ROOT / "tests" / "e2e" / "harness_install" / "node_modules" / ".bin"
FIXTURES = ROOT / "tests" / "fixtures" / "sessions"
MODEL = "polar-scripted"
PROMPT = "Create a file named hello.txt containing the word hello, using the shell."
FINAL = "Done: hello.txt now contains the word hello."
SHELL_COMMAND = "echo hello > hello.txt"
RECORDED = tuple(name for name, preset in PRESETS.items() if preset.shell_tool is not None)


def script_for(preset: Preset) -> dict:
    """The harness's shell tool first; the final message once a tool result is in the prompt (any later call too)."""
    call = "<tool_call>\n" + json.dumps(preset.shell_tool.call(SHELL_COMMAND)) + "\n</tool_call>"
    return {
        "name": MODEL,
        "rules": [{"prompt_regex": "<tool_response>", "text": FINAL}],
        "outputs": [{"text": call}],
        "cycle": True,
    }


async def record(
    name: str, timeout: float, out_dir: Path, keep_responses: bool, search_path: str
) -> common_pb2.Trajectory:
    preset = PRESETS[name]
    async with running_gateway(script_for(preset)) as gw:
        key = gw.open_session(task_id=f"record-{name}")
        with tempfile.TemporaryDirectory(prefix=f"polar-{name}-") as tmp:
            home, work = Path(tmp) / "home", Path(tmp) / "work"
            home.mkdir()
            work.mkdir()
            context = HarnessContext(
                instruction=PROMPT,
                base_url=gw.base_url,
                key=key,
                model=MODEL,
                home=home,
                workspace=work,
                session_id=key,
                task_id=f"record-{name}",
            )
            launch = prepare_launch(rollout_pb2.HarnessSpec(preset=name), context, search_path=search_path)
            proc = await asyncio.create_subprocess_exec(
                *launch.argv,
                cwd=work,
                env=launch.env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
            try:
                output, _ = await asyncio.wait_for(proc.communicate(), timeout)
            except TimeoutError:
                proc.kill()
                output, _ = await proc.communicate()
                print(f"{name}: timed out after {timeout:.0f}s", file=sys.stderr)
            print(f"--- {name} exited {proc.returncode}:\n{output.decode(errors='replace')[-4000:]}", file=sys.stderr)
            tool_ran = (work / "hello.txt").exists()
        records = gw.records(key)
    if not tool_ran:
        raise SystemExit(f"{name}: the shell tool call did not run (no hello.txt in the workspace); nothing written")
    if not keep_responses:
        for r in records:
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
    parser.add_argument("harnesses", nargs="+", choices=RECORDED)
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds a harness may run")
    parser.add_argument("--out", type=Path, default=FIXTURES, help="folder for the session files")
    parser.add_argument("--keep-responses", action="store_true", help="keep response bodies too (large)")
    parser.add_argument("--bin", type=Path, default=HARNESS_BIN, help="folder holding the CLIs (searched before PATH)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.harnesses:
        asyncio.run(record(name, args.timeout, args.out, args.keep_responses, str(args.bin)))


if __name__ == "__main__":
    main()
