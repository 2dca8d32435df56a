"""Following tasks as they run: `polar status [--watch]` and `polar up --submit`.

On a terminal `--watch` redraws the nodes and the task table in place with progress bars; into a
pipe or a log it prints one totals line per change and the tables once every group is released.
"""

from __future__ import annotations

import shutil
import sys
import time

from polar.rollout.client import RolloutClient, RolloutError
from polar.rollout.report import render_envoys, render_nodes, render_status, render_totals, summarize
from polar.v1 import rollout_pb2


def show_status(address: str, task_ids: list[str], watch: bool = False, interval_s: float = 1.0) -> None:
    """The nodes and the tasks' table once, or with `watch` until every task is released."""
    tty = sys.stdout.isatty()
    with RolloutClient(address) as client:
        nodes, tasks = client.status(task_ids)
        if not watch:
            envoys = render_envoys(client.upstreams())
            print("\n\n".join(part for part in (render_nodes(nodes), envoys, render_status(tasks)) if part))
            return
        last_totals = None
        while True:
            done = all(task.released for task in tasks)
            if tty:
                node_lines = render_nodes(nodes)
                # What the nodes, a blank line, the header, the totals and the cursor's line leave.
                rows = shutil.get_terminal_size().lines - node_lines.count("\n") - 5
                # Home and clear to the end, then draw: the screen replaces itself in place.
                sys.stdout.write(f"\x1b[H\x1b[J{node_lines}\n\n{render_status(tasks, bars=True, max_rows=rows)}\n")
                sys.stdout.flush()
            elif done:
                print(render_nodes(nodes) + "\n\n" + render_status(tasks), flush=True)
            else:
                # Not a terminal (a log, a pipe): one totals line per change, the tables at the end.
                totals = render_totals(summarize(tasks))
                if totals != last_totals:
                    print(totals, flush=True)
                    last_totals = totals
            if done:
                return
            time.sleep(interval_s)
            nodes, tasks = client.status(task_ids)


def submit_and_follow(address: str, tasks: list[rollout_pb2.Task]) -> None:
    """`polar up --submit`: the tasks submitted, a totals line per change, the table once all are
    released. Runs beside the supervisor; a failure is reported in one line and the stack serves on."""
    try:
        with RolloutClient(address) as client:
            task_ids = client.submit(tasks)
            print(f"polar up: submitted {len(task_ids)} task{'s' if len(task_ids) != 1 else ''}", flush=True)
            last = None
            while True:
                request = rollout_pb2.GetTaskStatusRequest(task_ids=task_ids)
                statuses = list(client.call("GetTaskStatus", request).tasks)
                if all(status.released for status in statuses):
                    print(render_status(statuses), flush=True)
                    export = f"polar results --export FILE --rollout {address}"
                    print(f"polar up: every group released; export them with `{export}`", flush=True)
                    return
                if (totals := render_totals(summarize(statuses))) != last:
                    print(f"polar up: {totals}", flush=True)
                    last = totals
                time.sleep(1.0)
    except RolloutError as exc:
        print(f"polar up: {exc}", file=sys.stderr, flush=True)
