"""`polar view` in a real browser (the system's Chromium through its chromedriver) against a real
`polar up`: its node runs harnesses that replay the recorded sessions of tests/fixtures/sessions
(each call's request as the CLI sent it, in its dialect), the scripted engine answers, and the viewer
follows the rollout server while the trainer's metrics come from the run folder.

Set POLAR_SCREENSHOT_DIR to keep a screenshot of every page the tests open.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from polar import credentials
from polar.codec import read_trajectory_batch
from polar.v1 import rollout_pb2, rollout_pb2_grpc
from tests.helpers.harness_programs import harness_command
from tests.helpers.polar_command import spawned
from tests.helpers.stack_config import write_stack_config
from tests.helpers.view_runs import FIXTURES, HARNESSES, break_first_sampled_token, recorded, store_sessions, viewing

pytestmark = [pytest.mark.browser, pytest.mark.slow]

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the dev extra)")
from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402 - only once selenium is known to be there
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
CHROMEDRIVER = shutil.which("chromedriver")
if not (CHROMIUM and CHROMEDRIVER):
    pytest.skip("no Chromium and chromedriver here (apt-get install chromium chromium-driver)", allow_module_level=True)

REPLY = "Done: hello.txt now contains the word hello."
HOSTILE = '<script>window.__polar_pwned = 1</script><img src=x onerror="window.__polar_pwned = 2">'
# Session .0 of every group scores 1, the others 0: groups whose advantages are not all zero.
EVALUATOR = 'case "$POLAR_SESSION_ID" in *.0) echo 1;; *) echo 0;; esac'
WAIT_S = 30


def _task(task_id: str, argv: list[str], group_size: int = 2) -> rollout_pb2.Task:
    return rollout_pb2.Task(
        task_id=task_id,
        instruction=f"replay {task_id}",
        group_size=group_size,
        harness=rollout_pb2.HarnessSpec(preset="command", command=argv),
        evaluator=rollout_pb2.EvaluatorSpec(kind="command", command=EVALUATOR),
        timeout_seconds=120,
    )


def _replay_task(harness: str) -> rollout_pb2.Task:
    return _task(
        f"replay-{harness}", harness_command("replay_harness", "replay", str(FIXTURES / f"{harness}.json.zst"))
    )


def _stub(address: str):
    return credentials.channel(
        address, credentials.OPERATOR, credentials.for_commands(), [("grpc.max_receive_message_length", 1 << 28)]
    )


def _released(address: str, task_ids: list[str], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    with _stub(address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        while time.monotonic() < deadline:
            statuses = stub.GetTaskStatus(rollout_pb2.GetTaskStatusRequest(task_ids=task_ids), timeout=10).tasks
            if all(s.released for s in statuses):
                return
            time.sleep(0.3)
    raise AssertionError(f"tasks {task_ids} not released in {timeout} s")


def _trajectories(address: str) -> dict:
    with _stub(address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        batches = stub.WatchResults(rollout_pb2.WatchResultsRequest(until_caught_up=True), timeout=60)
        return {t.session_id: t for b in batches for t in read_trajectory_batch(b.zstd_trajectories)}


def _write_metrics(run_dir: Path, steps: list[list[str]]) -> None:
    from trainer.metrics import STEP_KEYS, MetricsLog

    log = MetricsLog(run_dir, resume_step=0)
    for number, task_ids in enumerate(steps, start=1):
        row = {key: 0.0 for key in STEP_KEYS} | {"step": number, "reward_mean": 0.5, "pass_rate": 0.25 * number}
        log.append(row | {"policy_version": number, "kl": 0.01 * number, "task_ids": task_ids})
    log.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """`polar up` whose sessions replayed every fixture (and one hostile session), a run folder with two
    steps over them, and `polar view` following the stack; yields (view URL, rollout address, run dir,
    trajectories by session id)."""
    root = tmp_path_factory.mktemp("view")
    run_dir = root / "run"
    run_dir.mkdir()
    script = root / "script.json"
    script.write_text(
        json.dumps(
            {
                "cycle": True,
                "rules": [{"prompt_regex": "polar_pwned", "text": "Reply " + HOSTILE}],
                "outputs": [{"text": REPLY}],
            }
        )
    )
    config = write_stack_config(
        root / "stack.toml",
        rollout={"store": run_dir / "rollout.db", "heartbeat_interval_s": 0.2},
        inference={"engine": "scripted", "script": script},
        envoy={"workers": 1},
        node={"init_workers": 2, "ready_slots": 2, "running_slots": 4, "postrun_workers": 2},
    )
    with spawned() as spawn:
        up, lines = spawn("up", "--config", str(config))
        lines.wait_for(r"^polar up: 4 services running", timeout=120)
        address = lines.wait_for(r"^\s+rollout\s+(\S+)\s+\d+\s").group(1)
        tasks = [_replay_task(h) for h in HARNESSES] + [
            _task("hostile", harness_command("replay_harness", "hostile"), 1)
        ]
        with _stub(address) as channel:
            rollout_pb2_grpc.RolloutServiceStub(channel).SubmitTasks(
                rollout_pb2.SubmitTasksRequest(tasks=tasks), timeout=30
            )
        _released(address, [t.task_id for t in tasks])
        _write_metrics(run_dir, [["replay-claude-code", "replay-codex"], [f"replay-{h}" for h in HARNESSES[2:]]])
        with viewing(spawn, "--rollout", address, "--run-dir", str(run_dir), "--model", "tiny") as url:
            yield url, address, run_dir, _trajectories(address)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tmp_path_factory.mktemp("chromium-profile")
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--window-size=1400,1000",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def _wait(driver, timeout: float = WAIT_S) -> WebDriverWait:
    """A wait that looks again when an element it holds was redrawn (the pages redraw as data arrives)."""
    return WebDriverWait(driver, timeout, ignored_exceptions=(StaleElementReferenceException,))


def _shot(driver, name: str) -> None:
    folder = os.environ.get("POLAR_SCREENSHOT_DIR")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(folder) / f"{name}.png"))


def _open(driver, url: str, css: str):
    driver.get("about:blank")  # a page load of its own: a new hash alone would keep the last page's nodes a while
    driver.get(url)
    return _wait(driver).until(lambda d: d.find_elements(By.CSS_SELECTOR, css))


def _render_all_blocks(driver) -> None:
    """Scrolls through the token view so that every lazily drawn block is drawn."""
    blocks = driver.find_elements(By.CSS_SELECTOR, "#tokens .block")
    for block in blocks:
        driver.execute_script("arguments[0].scrollIntoView()", block)
        _wait(driver).until(lambda d: block.get_attribute("data-rendered") == "1")


@pytest.mark.parametrize("harness", HARNESSES)
def test_the_calls_of_a_recorded_session_render_in_its_dialect(stack, browser, harness):
    url, _, _, trajectories = stack
    session_id = f"replay-{harness}.0"
    replayed = trajectories[session_id]
    original = recorded(harness)
    calls = _open(browser, f"{url}#/session/{session_id}", "#calls .call")

    assert [c.get_attribute("data-call") for c in calls] == [c.call_id for c in replayed.calls]
    dialect = {1: "openai_chat", 2: "openai_responses", 3: "anthropic_messages", 4: "google_generate_content"}[
        original.calls[0].dialect
    ]
    assert {c.get_attribute("data-dialect") for c in calls} == {dialect}
    # The last call's request is the CLI's own: its tool call's result turn is drawn as one.
    last = calls[-1]
    browser.execute_script("arguments[0].scrollIntoView()", last)
    _wait(browser).until(lambda d: last.find_elements(By.CSS_SELECTOR, ".part.kind-tool_result"))
    assert last.find_elements(By.CSS_SELECTOR, ".part.kind-tool_call")
    assert REPLY in calls[0].text  # the stack's reply, decoded from the response
    # The sampling it ran with; a truncation the contract's zero value leaves off is not shown.
    sampling = replayed.calls[0].sampling
    assert f"max {sampling.max_tokens}" in calls[0].text
    assert ("top_k" in calls[0].text) == (sampling.top_k > 0)
    assert "polar verify: ok" in browser.find_element(By.ID, "verify").text
    assert browser.find_elements(By.CSS_SELECTOR, "#forks li[data-trace]")
    _shot(browser, f"session-{harness}")


@pytest.mark.parametrize("harness", ["pi", "codex"])
def test_the_token_view_shows_the_traces_mask_and_logprobs(stack, browser, harness):
    url, _, _, trajectories = stack
    session_id = f"replay-{harness}.1"
    trace = trajectories[session_id].traces[0]
    _open(browser, f"{url}#/session/{session_id}/trace/{trace.trace_id}", "#tokens .block")
    _render_all_blocks(browser)

    masks = browser.execute_script(
        "return [...document.querySelectorAll('#tokens .tok')].map(t => Number(t.dataset.mask))"
    )
    assert masks == list(trace.loss_mask)
    sampled = browser.find_elements(By.CSS_SELECTOR, "#tokens .tok.sampled")
    assert len(sampled) == sum(trace.loss_mask)
    assert all(s.value_of_css_property("background-color") not in ("rgba(0, 0, 0, 0)", "") for s in sampled[:20])
    assert not browser.find_elements(By.CSS_SELECTOR, "#tokens .tok.bad")
    assert "advantage -" in browser.find_element(By.TAG_NAME, "main").text  # session .1 scored 0 in a group with a 1
    _shot(browser, f"tokens-{harness}")


def test_from_the_reward_plot_to_a_session_of_the_last_step_and_its_tokens_in_three_clicks(stack, browser):
    url, *_ = stack
    points = _open(browser, f"{url}#/", "svg.plot[data-key=reward_mean] .point")
    _shot(browser, "run")
    points[-1].click()  # 1: the last step
    links = _wait(browser).until(lambda d: d.find_elements(By.CSS_SELECTOR, "a.session-link"))
    assert browser.current_url.endswith("#/step/2")
    assert {t.get_attribute("data-task") for t in browser.find_elements(By.CSS_SELECTOR, "table.sessions")} == {
        f"replay-{h}" for h in HARNESSES[2:]
    }
    _shot(browser, "step")
    links[0].click()  # 2: one of its sessions, with its calls
    _wait(browser).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#calls .call"))
    browser.find_element(By.CSS_SELECTOR, "#forks a.trace-link").click()  # 3: its token view
    _wait(browser).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#tokens .tok"))
    assert "/trace/" in browser.current_url


def test_filters_and_search_narrow_the_tasks(stack, browser):
    url, *_ = stack
    _open(browser, f"{url}#/", "tr.task-row")
    search = browser.find_element(By.ID, "search")
    search.send_keys("replay-pi.1")
    _wait(browser).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "tr.task-row")) == 1)
    assert browser.find_element(By.CSS_SELECTOR, "tr.task-row").get_attribute("data-task") == "replay-pi"
    assert browser.find_element(By.CSS_SELECTOR, "#task-list a[href='#/session/replay-pi.1']")
    search.clear()
    search.send_keys(" ")
    browser.find_element(By.ID, "filter-min").send_keys("0.75")  # only the hostile task's lone session scored 1... or 0
    _wait(browser).until(
        lambda d: {r.get_attribute("data-task") for r in d.find_elements(By.CSS_SELECTOR, "tr.task-row")} <= {"hostile"}
    )
    _shot(browser, "filtered")


def test_text_a_harness_or_model_wrote_runs_no_script(stack, browser):
    url, *_ = stack
    calls = _open(browser, f"{url}#/session/hostile.0", "#calls .call")
    _wait(browser).until(lambda d: calls[0].find_elements(By.CSS_SELECTOR, ".part.kind-tool_result"))
    browser.find_element(By.CSS_SELECTOR, "#calls .call details summary").click()  # the system text too
    text = browser.find_element(By.ID, "calls").text
    assert "tool says " + HOSTILE in text  # the tool result, as text
    assert "Reply " + HOSTILE in text  # the model's reply, as text
    assert "You are a test. " + HOSTILE in text  # the system prompt
    assert browser.execute_script("return window.__polar_pwned") is None
    assert not browser.find_elements(By.CSS_SELECTOR, "#calls script, #calls img")
    _shot(browser, "hostile")


def test_a_group_released_while_the_page_is_open_appears_without_a_reload(stack, browser):
    url, address, *_ = stack
    _open(browser, f"{url}#/", "tr.task-row")
    browser.execute_script("window.__same_page = true")
    with _stub(address) as channel:
        task = _replay_task("pi")
        task.task_id = "live-pi"
        rollout_pb2_grpc.RolloutServiceStub(channel).SubmitTasks(
            rollout_pb2.SubmitTasksRequest(tasks=[task]), timeout=30
        )

    def live_cells(driver):
        # Read in one script: the page redraws its rows as the task's status changes, so an element found
        # by one call can be gone by the next.
        return driver.execute_script(
            "const cells = document.querySelectorAll('tr.task-row[data-task=\"live-pi\"] td');"
            "return cells.length ? [...cells].map((td) => td.innerText) : null;"
        )

    # The task's harness, from the server's task status, as soon as its row shows (before any session ends).
    cells = _wait(browser, 120).until(live_cells)
    assert cells[-1] == "command"
    _wait(browser, 120).until(lambda d: (cells := live_cells(d)) is not None and "released" in " ".join(cells))
    assert browser.execute_script("return window.__same_page") is True
    assert "live" in browser.find_element(By.ID, "live").text
    _shot(browser, "live")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished run's folder whose store holds a session with a trace that is not what the engine
    sampled, and `polar view --run-dir` on it; yields (URL, the broken token's position)."""
    folder = tmp_path_factory.mktemp("finished")
    broken = recorded("pi")
    position = break_first_sampled_token(broken)
    store_sessions(folder / "rollout.db", {"broken": [(broken, 1.0)]})
    with spawned() as spawn, viewing(spawn, "--run-dir", str(folder), "--model", "tiny") as url:
        yield url, position


def test_a_broken_trace_is_marked_where_polar_verify_fails(finished_run, browser):
    url, position = finished_run
    _open(browser, f"{url}#/session/broken.0", "#calls .call")
    assert "polar verify would fail" in browser.find_element(By.ID, "verify").text
    _shot(browser, "broken-session")
    _open(browser, f"{url}#/session/broken.0/trace/t0", "#tokens .block")
    _render_all_blocks(browser)
    bad = browser.find_elements(By.CSS_SELECTOR, "#tokens .tok.bad")
    assert position in {int(b.get_attribute("data-i")) for b in bad}
    assert "polar verify would fail here" in browser.find_element(By.ID, "verify").text
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", bad[0])
    _shot(browser, "broken-tokens")


def test_a_session_the_trainers_screening_left_out_says_why_in_place_of_its_advantage(browser, tmp_path):
    short, long = recorded("pi"), recorded("claude-code")  # 1.6k and 20k tokens
    store_sessions(tmp_path / "rollout.db", {"mixed": [(short, 1.0), (short, 0.0), (long, 1.0)]})
    config = tmp_path / "run.toml"
    config.write_text('[trainer]\nmax_tokens_per_microbatch = 4096\ntoo_long = "session"\n')
    with spawned() as spawn, viewing(spawn, "--run-dir", str(tmp_path), "--config", str(config)) as url:
        _open(browser, f"{url}#/task/mixed", "table.sessions tr[data-session]")
        cells = {
            row.get_attribute("data-session"): row.find_elements(By.TAG_NAME, "td")[4]
            for row in browser.find_elements(By.CSS_SELECTOR, "table.sessions tr[data-session]")
        }
        assert [cells[f"mixed.{i}"].text for i in range(2)] == ["1.000", "-1.000"]  # over the two kept sessions
        assert cells["mixed.2"].text == "left out"
        assert "longer than the trainer's 4096 tokens" in cells["mixed.2"].get_attribute("title")
        _shot(browser, "screened-task")
        _open(browser, f"{url}#/session/mixed.2", "#calls .call")
        assert "4096 tokens" in browser.find_element(By.ID, "left-out").text
        _open(browser, f"{url}#/session/mixed.2/trace/t0", "#tokens .block")
        assert "not trained on" in browser.find_element(By.ID, "left-out").text


@pytest.mark.parametrize("made", [True, False], ids=["empty", "missing"])
def test_an_empty_or_missing_run_folder_page_says_so(browser, tmp_path, made):
    folder = tmp_path / "runs" / "example"
    if made:
        folder.mkdir(parents=True)
    with spawned() as spawn, viewing(spawn, "--run-dir", str(folder)) as url:
        _open(browser, url, "#no-tasks")
        text = browser.find_element(By.ID, "main").text
        assert ("no training steps" if made else "does not exist") in text
        assert "no rollout store" in text
        _shot(browser, f"run-folder-{'empty' if made else 'missing'}")
