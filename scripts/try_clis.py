"""Ask each agent CLI one question through a running stack and time it, start to exit.

    .venv/bin/polar up                                   # in another terminal: the default stack
    npm ci --prefix tests/e2e/harness_install            # the pinned CLIs, once
    .venv/bin/python scripts/try_clis.py                 # all five presets, one after the other
    .venv/bin/python scripts/try_clis.py codex pi --question "Name a prime number."

For each preset: a session is opened on the stack's gateway (GatewayService, as `polar session open`
does), the CLI is started exactly as a node starts it (polar/rollout/harness.py: headless flags,
config files written into a private, empty HOME, every base URL pointed at Envoy's harness listener)
in an empty workspace, and the wall clock runs from its start to its exit. The session's call records
are then read back, once the session is closed and its calls in flight are recorded. One line per CLI:
exit code, seconds, and per call the prompt tokens, the tokens sampled, the max tokens the engine was
given and why the generation ended; then the CLI's last lines of output with --show-output.

This is how a newcomer's first hour goes: the default `polar up` serves the random `tiny` model, so
the answers are noise; what is measured is that every CLI finishes its session, and how fast.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from polar import credentials
from polar.config import EnvoyConfig, GatewayConfig
from polar.rollout.harness import PRESETS, HarnessContext, HarnessError, prepare_launch
from polar.service_base import join_host_port
from polar.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, rollout_pb2

ROOT = Path(__file__).resolve().parent.parent
HARNESS_BIN = ROOT / "tests" / "e2e" / "harness_install" / "node_modules" / ".bin"
CLI_PRESETS = tuple(name for name, preset in PRESETS.items() if preset.shell_tool is not None)
QUESTION = "In one sentence, what is a hash table?"
# A session's records hold whole prompts; Claude Code's first alone is ~130 kB of JSON.
RECORD_BYTES = 256 * 1024 * 1024


@dataclass
class Outcome:
    preset: str
    exit_code: int | None  # None: killed at the timeout
    seconds: float
    output: str
    calls: list[common_pb2.CallRecord] = field(default_factory=list)

    def line(self) -> str:
        status = "timed out" if self.exit_code is None else f"exit {self.exit_code}"
        calls = "; ".join(
            f"prompt {len(c.prompt_token_ids)} sampled {len(c.sampled_token_ids)}/{c.sampling.max_tokens} "
            f"{common_pb2.FinishReason.Name(c.finish_reason).removeprefix('FINISH_REASON_').lower()}"
            f"{' truncated' if c.truncated else ''}{' error: ' + c.error if c.error else ''}"
            for c in self.calls
        )
        return f"{self.preset:<12} {status:<10} {self.seconds:7.1f} s  {len(self.calls)} calls: {calls}"


def served_model(base_url: str, key: str) -> tuple[str, int]:
    """The model the gateway serves (GET /v1/models): the name the presets must ask for, and its
    context window (0 when the gateway does not say)."""
    request = urllib.request.Request(base_url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        model = json.load(response)["data"][0]
    return model["id"], model.get("max_model_len", 0)


def try_cli(preset: str, args: argparse.Namespace, stub) -> Outcome:
    session = stub.OpenSession(gateway_pb2.OpenSessionRequest(task_id=f"try-{preset}"), timeout=10).session
    try:
        with tempfile.TemporaryDirectory(prefix=f"polar-try-{preset}-") as scratch:
            home, workspace = Path(scratch) / "home", Path(scratch) / "workspace"
            home.mkdir()
            workspace.mkdir()
            model, context_length = served_model(args.base_url, session.key)
            context = HarnessContext(
                instruction=args.question,
                base_url=args.base_url,
                key=session.key,
                model=args.model or model,
                home=home,
                workspace=workspace,
                session_id=session.session_id,
                task_id=f"try-{preset}",
                context_length=context_length,
            )
            launch = prepare_launch(rollout_pb2.HarnessSpec(preset=preset), context, search_path=args.harness_path)
            started = time.monotonic()
            process = subprocess.Popen(
                launch.argv,
                cwd=workspace,
                env=launch.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                output, _ = process.communicate(timeout=args.timeout_s)
                exit_code = process.returncode
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)  # the CLI and whatever it started
                output, _ = process.communicate()
                exit_code = None
            seconds = time.monotonic() - started
    finally:
        stub.CloseSession(gateway_pb2.CloseSessionRequest(key=session.key), timeout=10)
    # Read after closing: the stream then ends once the calls still in flight (a CLI may exit without
    # waiting for its last stream to end) are recorded too.
    watch = gateway_pb2.WatchSessionRequest(key=session.key)
    calls = [message.call for message in stub.WatchSession(watch, timeout=300)]
    return Outcome(preset, exit_code, seconds, output.decode(errors="replace"), calls)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "presets", nargs="*", metavar="PRESET", help=f"the CLIs to try: {', '.join(CLI_PRESETS)} (default: all five)"
    )
    parser.add_argument("--question", default=QUESTION, help="the instruction each CLI is given (default: %(default)r)")
    envoy, gateway = EnvoyConfig(), GatewayConfig()
    parser.add_argument(
        "--base-url",
        default=f"http://{join_host_port(envoy.host, envoy.harness_port)}",
        help="the harnesses' base URL: Envoy's harness listener (default: %(default)s)",
    )
    parser.add_argument(
        "--gateway",
        default=join_host_port(gateway.host, gateway.grpc_port),
        metavar="HOST:PORT",
        help="GatewayService address (default: %(default)s)",
    )
    parser.add_argument("--model", default="", help="the model name the CLIs ask for (default: the one served)")
    parser.add_argument(
        "--harness-path",
        default=str(HARNESS_BIN),
        help="folders searched for the CLIs before PATH (default: the pinned install, tests/e2e/harness_install)",
    )
    parser.add_argument("--timeout-s", type=float, default=300.0, help="a CLI still running then is killed")
    parser.add_argument("--show-output", action="store_true", help="print each CLI's last 2000 characters of output")
    args = parser.parse_args()
    unknown = [name for name in args.presets if name not in CLI_PRESETS]
    if unknown:
        parser.error(f"unknown preset {', '.join(unknown)} (known: {', '.join(CLI_PRESETS)})")

    outcomes = []
    with credentials.channel(
        args.gateway,
        credentials.OPERATOR,
        credentials.for_commands(),
        [("grpc.max_receive_message_length", RECORD_BYTES)],
    ) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        for preset in args.presets or CLI_PRESETS:
            try:
                outcome = try_cli(preset, args, stub)
            except grpc.RpcError as exc:
                print(
                    f"try_clis: the gateway at {args.gateway}: {exc.code().name}: {exc.details()} (is `polar up` running?)"
                )
                return 1
            except HarnessError as exc:
                print(f"try_clis: {exc}")
                return 1
            except urllib.error.URLError as exc:
                print(f"try_clis: the harness base URL {args.base_url}: {exc.reason} (is `polar up` running?)")
                return 1
            outcomes.append(outcome)
            print(outcome.line(), flush=True)
            if args.show_output:
                print(outcome.output[-2000:].rstrip() + "\n", flush=True)
    return 0 if all(o.exit_code == 0 for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
