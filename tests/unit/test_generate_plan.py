"""polar/app/generate/plan.py (which attempt runs next, acceptance, caps) and the run folder's record."""

from __future__ import annotations

import json
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar.app.generate.folder import RunFolder, parse_task_id, task_id
from polar.app.generate.plan import Tally, accepted, attempt_order, next_attempt

# Drawing is cheap but the machine may be busy: no deadline, and no health check on slow draws.
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(st.integers(1, 12), st.integers(1, 6), st.integers(0, 2**32))
def test_the_order_holds_every_attempt_once_in_rounds(tasks, attempts, seed):
    order = list(attempt_order(tasks, attempts, seed))
    assert sorted(order) == [(t, n) for t in range(tasks) for n in range(attempts)]
    # Round n (every task's attempt n) comes whole before round n + 1.
    assert [n for _, n in order] == sorted(n for _, n in order)
    assert order == list(attempt_order(tasks, attempts, seed))


@SETTINGS
@given(
    st.sampled_from(["completed", "timed_out", "failed", "cancelled"]),
    st.floats(-2, 2),
    st.floats(-1, 1),
    st.integers(0, 3),
)
def test_only_completed_passing_attempts_without_failed_calls_are_accepted(outcome, reward, threshold, failed):
    assert accepted(outcome=outcome, reward=reward, threshold=threshold, failed_calls=failed) == (
        outcome == "completed" and reward >= threshold and failed == 0
    )


@SETTINGS
@given(st.integers(1, 6), st.integers(1, 6), st.integers(0, 3), st.integers(1, 5), st.integers(0, 2**32))
def test_a_capped_run_never_accepts_more_than_the_cap(tasks, attempts, cap, concurrency, seed):
    """Attempts finish in a random order and pass at random; no task ends above its cap, and a task
    below it has run every attempt."""
    rng = random.Random(seed)
    order = list(attempt_order(tasks, attempts, seed))
    tally, started, running = Tally(), set(), []
    while True:
        per_task = {}
        for t, _ in running:
            per_task[t] = per_task.get(t, 0) + 1
        while (
            len(running) < concurrency and (attempt := next_attempt(order, started, tally, per_task, cap)) is not None
        ):
            started.add(attempt)
            running.append(attempt)
            per_task[attempt[0]] = per_task.get(attempt[0], 0) + 1
        if not running:
            break
        done = running.pop(rng.randrange(len(running)))
        tally.add(done[0], "completed", rng.random() < 0.5)
    for task in range(tasks):
        kept = tally.accepted_per_task.get(task, 0)
        ran = sum(1 for t, _ in started if t == task)
        assert cap == 0 or kept <= cap
        assert kept == cap or ran == attempts


def test_task_ids_name_their_run_and_attempt():
    assert task_id("ab12", (3, 7)) == "gen-ab12-000003-0007"
    assert parse_task_id("gen-ab12-000003-0007", "ab12") == (3, 7)
    assert parse_task_id("gen-ffff-000003-0007", "ab12") is None
    assert parse_task_id("train-000003", "ab12") is None


def test_rows_of_an_attempt_never_recorded_are_dropped(tmp_path):
    """A run killed between an attempt's rows and its line: the rows go, so a rerun exports it once."""
    folder = RunFolder(tmp_path)
    run_id = folder.run_id()
    folder.record(
        {"task_index": 0, "attempt": 0, "outcome": "completed", "accepted": True},
        [{"task_index": 0, "attempt": 0, "x": 1}],
    )
    with folder.accepted_path.open("a") as f:
        f.write(json.dumps({"task_index": 1, "attempt": 0, "x": 2}) + "\n")
    again = RunFolder(tmp_path)
    assert len(again.done()) == 1
    assert [json.loads(line)["x"] for line in again.accepted_path.read_text().splitlines()] == [1]
    assert RunFolder(tmp_path).run_id() == run_id  # kept from its first use: a rerun knows its tasks
