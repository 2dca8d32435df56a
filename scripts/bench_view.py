"""How fast `polar view` opens a large session: a 30-call Claude Code session whose prompts are ~20k
tokens each, in the system's Chromium (headless, through chromedriver).

    .venv/bin/python scripts/bench_view.py [--calls 30] [--runs 5]

The session is the recorded Claude Code fixture's last call grown call by call (one more tool call
and its result each time, the prompt ids extended to match), its traces built by prefix merging, put
into a rollout store as a node reports it. Measured: from navigating to the session until its calls
are drawn, and to a trace's token view until its first tokens are drawn; the goal is under a second
for the session. The page draws only what is on screen (call bodies and token blocks as they scroll
in), and each call's prompt as the difference from the call before.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "integration")]

from view_runs import recorded, store_sessions  # noqa: E402

from polar.trajectory import build  # noqa: E402
from polar.trajectory.records import views_from_protos  # noqa: E402
from polar.trajectory.session_file import session_trajectory  # noqa: E402
from polar.v1 import common_pb2  # noqa: E402


def large_session(calls: int) -> common_pb2.Trajectory:
    base = recorded("claude-code").calls[-1]
    body = json.loads(base.request_body)
    records = []
    prompt = list(base.prompt_token_ids)
    for index in range(calls):
        record = common_pb2.CallRecord()
        record.CopyFrom(base)
        record.call_id = f"c{index + 1:04d}"
        record.prompt_token_ids[:] = prompt
        if index:
            record.extends_call_id = records[-1].call_id
        record.request_body = json.dumps(body).encode()
        records.append(record)
        # The next call: this reply, one more tool call and its result.
        prompt = prompt + list(record.sampled_token_ids) + [198 + (index % 50)] * 40
        tool_id = f"toolu_{index:04d}"
        body["messages"] += [
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": tool_id, "name": "Bash", "input": {"command": f"ls step{index}"}}
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": tool_id, "content": f"file{index}.txt\n" * 20}],
            },
        ]
    result = build("prefix_merging", views_from_protos(records))
    return session_trajectory(records, result, "bench.0")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver_path):
        print("bench_view: needs chromium and chromedriver (apt-get install chromium chromium-driver)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        trajectory = large_session(args.calls)
        prompts = [len(c.prompt_token_ids) for c in trajectory.calls]
        store_sessions(folder / "rollout.db", {"bench": [(trajectory, 1.0)]}, preset="claude-code")
        view = subprocess.Popen(
            [sys.executable, "-m", "polar", "view", "--port", "0", "--run-dir", str(folder), "--model", "tiny"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            url = view.stdout.readline().split()[3]
            options = webdriver.ChromeOptions()
            options.binary_location = chromium
            for flag in (
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={folder / 'profile'}",
                "--window-size=1400,1000",
            ):
                options.add_argument(flag)
            driver = webdriver.Chrome(service=Service(driver_path), options=options)
            try:
                session, tokens = [], []
                for run in range(args.runs + 1):  # the first run warms the server's tokenizer
                    driver.get("about:blank")
                    started = time.perf_counter()
                    driver.get(f"{url}#/session/bench.0")
                    WebDriverWait(driver, 60).until(
                        lambda d: len(d.find_elements(By.CSS_SELECTOR, "#calls .call")) == args.calls
                    )
                    opened = time.perf_counter() - started
                    driver.get("about:blank")
                    started = time.perf_counter()
                    driver.get(f"{url}#/session/bench.0/trace/{trajectory.traces[0].trace_id}")
                    WebDriverWait(driver, 60).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#tokens .tok"))
                    traced = time.perf_counter() - started
                    if run:
                        session.append(opened)
                        tokens.append(traced)
                drawn = driver.execute_script("return document.querySelectorAll('#tokens .tok').length")
            finally:
                driver.quit()
        finally:
            view.terminate()
            view.wait(timeout=30)
    print(f"session: {args.calls} calls, prompts {min(prompts)}-{max(prompts)} tokens, {len(trajectory.traces)} traces")
    print(f"open the session (calls drawn):  median {statistics.median(session):.3f} s, max {max(session):.3f} s")
    print(
        f"open its first trace ({len(trajectory.traces[0].token_ids)} tokens; {drawn} drawn on screen): "
        f"median {statistics.median(tokens):.3f} s, max {max(tokens):.3f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
