"""`polar view` as a user starts it, without a browser: what it serves from a run folder (recorded
sessions in a real rollout store), that it changes nothing and answers only on loopback, and what it
says of a run folder that is empty or missing."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import pytest

from tests.helpers.polar_command import spawned
from tests.helpers.view_runs import HARNESSES, break_first_sampled_token, recorded, store_sessions, url_port, viewing

pytestmark = pytest.mark.slow


@pytest.fixture
def spawn():
    with spawned() as start:
        yield start


def _get(url: str, method: str = "GET", headers: dict | None = None) -> tuple[int, bytes, dict]:
    request = urllib.request.Request(
        url, method=method, headers=headers or {}, data=b"{}" if method in ("POST", "PUT") else None
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


def _api(url: str, path: str) -> dict:
    status, body, _ = _get(url + path)
    assert status == 200, body
    return json.loads(body)


@pytest.fixture
def run_dir(tmp_path):
    broken = recorded("pi")
    position = break_first_sampled_token(broken)
    groups = {f"replay-{h}": [(recorded(h), 1.0), (recorded(h), 0.0)] for h in HARNESSES}
    store_sessions(tmp_path / "rollout.db", groups | {"broken": [(broken, 1.0)]})
    return tmp_path, position


def test_a_finished_runs_store_is_read_with_advantages_and_verification(spawn, run_dir):
    folder, position = run_dir
    with viewing(spawn, "--run-dir", str(folder)) as url:
        overview = _api(url, "api/overview")
        assert [t["task_id"] for t in overview["tasks"]] == [*(f"replay-{h}" for h in HARNESSES), "broken"]
        assert "no training steps" in overview["run_problem"]
        task = _api(url, "api/task/replay-pi")
        assert [s["advantage"] for s in task["sessions"]] == pytest.approx([1.0, -1.0], abs=1e-5)  # (r - mean) / std
        session = _api(url, "api/session/broken.0")
        assert not session["verify"]["ok"]
        trace = _api(url, f"api/session/broken.0/trace/{session['traces'][0]['trace_id']}")
        assert position in {bad["position"] for bad in trace["bad"]}
        assert trace["pieces"] is None  # no model given: the tokens are shown as ids
        assert _api(url, "api/session/replay-pi.0")["verify"]["ok"]


@pytest.mark.parametrize("too_long", ["session", "group"])
def test_advantages_are_over_the_sessions_the_trainers_screening_keeps(spawn, tmp_path, too_long):
    from trainer.metrics import STEP_KEYS, MetricsLog

    short, long = recorded("pi"), recorded("claude-code")  # 1.6k and 20k tokens: a 4096-token micro-batch
    groups = {
        "mixed": [(short, 1.0), (short, 0.0), (short, 1.0), (long, 0.0)],
        "stale": [(short, 1.0), (short, 0.0)],
        "whole": [(short, 1.0), (short, 0.0)],
    }
    store_sessions(tmp_path / "rollout.db", groups)
    log = MetricsLog(tmp_path, resume_step=0)
    log.append({key: 0.0 for key in STEP_KEYS} | {"step": 1, "task_ids": ["whole"], "task_ids_dropped": ["stale"]})
    log.close()
    config = tmp_path / "run.toml"
    config.write_text(f'[trainer]\nmax_tokens_per_microbatch = 4096\ntoo_long = "{too_long}"\n')
    with viewing(spawn, "--run-dir", str(tmp_path), "--config", str(config)) as url:
        mixed = _api(url, "api/task/mixed")["sessions"]
        if too_long == "session":
            # The long session is not trained on; the others' advantages are those of rewards 1, 0, 1.
            assert [s["advantage"] for s in mixed[:3]] == pytest.approx([0.7071, -1.4142, 0.7071], abs=1e-4)
            assert mixed[3]["advantage"] is None and "it holds a trace longer than" in mixed[3]["left_out"]
            assert [s["left_out"] for s in mixed[:3]] == [None] * 3
        else:
            assert [s["advantage"] for s in mixed] == [None] * 4
            assert "another session of its group holds" in mixed[0]["left_out"]
        assert "4096 tokens" in _api(url, "api/session/mixed.3")["left_out"]
        stale = _api(url, "api/task/stale")["sessions"]
        assert [s["advantage"] for s in stale] == [None, None]
        assert all("left out of step 1" in s["left_out"] for s in stale)
        whole = _api(url, "api/task/whole")["sessions"]
        assert [s["advantage"] for s in whole] == pytest.approx([1.0, -1.0], abs=1e-5)
        assert [s["left_out"] for s in whole] == [None, None]


def test_nothing_is_written_and_markup_is_never_inlined(spawn, run_dir):
    folder, _ = run_dir
    with viewing(spawn, "--run-dir", str(folder)) as url:
        for method in ("POST", "PUT", "DELETE", "PATCH"):
            status, _, headers = _get(url + "api/overview", method)
            assert status == 405 and headers["Allow"] == "GET, HEAD"
        status, page, headers = _get(url)
        assert status == 200
        assert (
            "script-src 'self'" in headers["Content-Security-Policy"]
            and "unsafe-inline" not in headers["Content-Security-Policy"]
        )
        assert b"<script>" not in page  # the page's only script is a file: no inline script is admitted
        status, _, _ = _get(url + "api/overview", headers={"Host": f"attacker.example:{url_port(url)}"})
        assert status == 421  # a name rebound to 127.0.0.1 does not reach the app


def test_it_answers_only_on_loopback_by_default(spawn, tmp_path):
    with viewing(spawn, "--run-dir", str(tmp_path)) as url:
        assert url.startswith("http://127.0.0.1:")
        port = url_port(url)
        other = _non_loopback_address()
        if other is None:
            pytest.skip("this machine has no address but loopback")
        with pytest.raises(OSError):
            socket.create_connection((other, port), timeout=5).close()


def _non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent, the route picks the address
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


@pytest.mark.parametrize("made", [True, False], ids=["empty", "missing"])
def test_an_empty_or_missing_run_folder_is_a_page_that_says_so(spawn, tmp_path, made):
    folder = tmp_path / "runs" / "example"
    if made:
        folder.mkdir(parents=True)
    with viewing(spawn, "--run-dir", str(folder)) as url:
        status, page, _ = _get(url)
        assert status == 200 and b"polar view" in page
        overview = _api(url, "api/overview")
        assert overview["tasks"] == [] and overview["steps"] == []
        assert ("no training steps" if made else "does not exist") in overview["run_problem"]
        assert "no rollout store" in overview["problem"]
        assert _get(url + "api/session/nothing.0")[0] == 404
