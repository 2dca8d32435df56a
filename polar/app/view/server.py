"""`polar view`: a read-only web app over a run, served on loopback.

    GET /                                   the page (static/index.html, app.js, app.css: no build step,
                                            no network: every byte it needs is served from here)
    GET /api/overview                       the run's steps (metrics.jsonl), tasks, where they come from
    GET /api/step/N                         one step's metrics and the groups it trained on
    GET /api/task/ID                        one task's group: sessions, rewards, advantages
    GET /api/session/ID                     one session: calls, forks, verification, outputs
    GET /api/session/ID/trace/TRACE         one trace's tokens, mask, logprobs, verification marks
    GET /api/events                         Server-Sent Events: "changed" whenever any of the above did

Everything else is refused: other methods with 405 (nothing here changes anything), and a request
whose Host is not this loopback address with 421, so a web page elsewhere cannot reach the app
through a name that resolves to 127.0.0.1 (DNS rebinding). The page builds its DOM with textContent
only, and the Content-Security-Policy admits no inline script: text a harness or a model wrote is
shown, never run.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from polar.app.view import session as pages
from polar.app.view.catalog import METRICS_FILE, ROLLOUT_STORE, Catalog, EmptyCatalog, RolloutCatalog, StoreCatalog

log = logging.getLogger("polar.view")

STATIC = Path(__file__).with_name("static")
STATIC_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
EVENT_POLL_S = 0.5
HEARTBEAT_S = 15.0
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
# The step metrics the run page plots, in order; a run's row may lack some (older runs).
PLOTTED = (
    ("reward_mean", "reward"),
    ("pass_rate", "pass rate"),
    ("kl", "KL"),
    ("clip_fraction", "clip fraction"),
    ("loss", "loss"),
    ("policy_version", "policy version"),
    ("staleness_max", "staleness (versions)"),
    ("seconds_rollout_wait", "rollout wait (s)"),
    ("seconds_train", "train (s)"),
    ("seconds_weight_sync", "weight sync (s)"),
)


@dataclass(frozen=True)
class ViewOptions:
    run_dir: Path | None
    rollout: str  # HOST:PORT of a running rollout server; "" = read the run folder's store
    host: str
    port: int
    model: str  # tokenizer of the token view; "" = ids only
    advantage_scale: str
    leave_one_out: bool
    # The trainer's screening ([trainer] too_long, and the tokens of its micro-batch: a longer trace is
    # not trained on); 0 tokens = unknown, no trace is screened as too long.
    too_long: str = "group"
    microbatch_tokens: int = 0


@dataclass(frozen=True)
class GroupView:
    """A finished group as the trainer takes it: each trained session's advantage, and why the
    others were left out."""

    advantages: dict[str, float]
    left_out: dict[str, str]  # session id -> why screening left it out of training


class RunFolder:
    """The trainer's metrics.jsonl, read again when it changes."""

    def __init__(self, run_dir: Path | None) -> None:
        self.run_dir = run_dir
        self.rows: list[dict] = []
        self._stamp: tuple[float, int] | None = None
        self.version = 0

    def problem(self) -> str:
        if self.run_dir is None:
            return "no run folder given (--run-dir): no training steps to show"
        if not self.run_dir.is_dir():
            return f"no run folder {self.run_dir}: it does not exist (yet)"
        if not self.rows:
            return f"no training steps in {self.run_dir / METRICS_FILE} yet"
        return ""

    def refresh(self) -> None:
        if self.run_dir is None:
            return
        from trainer.metrics import read_metrics

        path = self.run_dir / METRICS_FILE
        try:
            st = path.stat()
            stamp = (st.st_mtime, st.st_size)
        except OSError:
            stamp = None
        if stamp != self._stamp:
            self._stamp = stamp
            self.rows = read_metrics(path) if stamp else []
            self.version += 1

    def step(self, number: int) -> dict | None:
        return next((row for row in self.rows if row.get("step") == number), None)

    def dropped_at(self, task_id: str) -> int | None:
        """The step that left this task's group out (stale, or a trace too long), if one did."""
        return next((row.get("step") for row in self.rows if task_id in row.get("task_ids_dropped", ())), None)


class Viewer:
    def __init__(self, options: ViewOptions, catalog: Catalog) -> None:
        self.options = options
        self.catalog = catalog
        self.run = RunFolder(options.run_dir)
        self.tokens = pages.Tokens(options.model)
        self._groups: dict[str, tuple[str, GroupView]] = {}  # task id -> (stamp, its view)

    # -- data ----------------------------------------------------------------------------------------

    def refresh(self) -> None:
        self.catalog.refresh()
        self.run.refresh()

    def stamp(self) -> str:
        return f"{self.catalog.version}.{self.run.version}"

    def group(self, task_id: str) -> GroupView:
        """The task's group as the trainer takes it, once the whole group is finished: screened as the
        trainer screens it (trainer.screening: a group the run left out, sessions or the whole group
        holding a trace too long), then each trained session's advantage from the rewards of those
        trained, with the run's settings."""
        stamp = self.stamp()
        cached = self._groups.get(task_id)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        view = self._group(task_id)
        self._groups[task_id] = (stamp, view)
        return view

    def _group(self, task_id: str) -> GroupView:
        rows = self.catalog.group_rewards(task_id)
        if not rows or not all(done for _, _, done in rows):
            return GroupView({}, {})
        step = self.run.dropped_at(task_id)
        if step is not None:
            reason = f"the group was left out of step {step} (stale, or a trace too long)"
            return GroupView({}, {session_id: reason for session_id, _, _ in rows})
        trained = {session_id for session_id, _, _ in rows}
        left_out: dict[str, str] = {}
        limit = self.options.microbatch_tokens
        trajectories = [self.catalog.trajectory(session_id) for session_id, _, _ in rows] if limit else []
        if limit and all(t is not None for t in trajectories):
            from polar.rollout.client import Group
            from trainer.screening import Screener

            screened = Screener(limit, self.options.too_long, lambda _: None).screen([Group("", trajectories)])
            kept = {t.session_id for group in screened.groups for t in group.trajectories}
            for trajectory in trajectories:
                longest = max((len(trace.token_ids) for trace in trajectory.traces), default=0)
                if trajectory.session_id not in kept:
                    whose = "it holds" if longest > limit else "another session of its group holds"
                    left_out[trajectory.session_id] = (
                        f"left out: {whose} a trace longer than the trainer's {limit} tokens "
                        f"(too_long = {self.options.too_long!r})"
                    )
            trained = kept
        rewards = [(session_id, reward) for session_id, reward, _ in rows if session_id in trained]
        values = pages.advantages([r for _, r in rewards], self.options.advantage_scale, self.options.leave_one_out)
        return GroupView({session_id: value for (session_id, _), value in zip(rewards, values)}, left_out)

    def overview(self) -> dict[str, Any]:
        tasks, sessions, _ = self.catalog.snapshot()
        steps = [
            {**{key: row.get(key) for key, _ in PLOTTED}, "step": row.get("step"), "task_ids": row.get("task_ids", [])}
            for row in self.run.rows
        ]
        return {
            "source": self.catalog.source,
            "problem": self.catalog.problem,
            "run_dir": str(self.options.run_dir) if self.options.run_dir else "",
            "run_problem": self.run.problem(),
            "live": isinstance(self.catalog, RolloutCatalog),
            "cursor": self.catalog.cursor,
            "plotted": [list(p) for p in PLOTTED],
            "steps": steps,
            "tasks": tasks,
            "session_ids": [s["session_id"] for s in sessions],
            "stamp": self.stamp(),
        }

    def task(self, task_id: str) -> dict[str, Any] | None:
        tasks, sessions, _ = self.catalog.snapshot()
        task = next((t for t in tasks if t["task_id"] == task_id), None)
        if task is None:
            return None
        group = self.group(task_id)
        rows = sorted((s for s in sessions if s["task_id"] == task_id), key=lambda s: s["index"])
        return {
            **task,
            "sessions": [
                {
                    **s,
                    "advantage": group.advantages.get(s["session_id"]),
                    "left_out": group.left_out.get(s["session_id"]),
                }
                for s in rows
            ],
        }

    def step(self, number: int) -> dict[str, Any] | None:
        row = self.run.step(number)
        if row is None:
            return None
        groups = [self.task(task_id) or {"task_id": task_id, "missing": True} for task_id in row.get("task_ids", [])]
        metrics = {k: v for k, v in row.items() if isinstance(v, (int, float, str)) and k != "task_ids"}
        return {"step": number, "metrics": metrics, "groups": groups, "dropped": row.get("task_ids_dropped", [])}

    def session(self, session_id: str) -> dict[str, Any] | None:
        trajectory = self.catalog.trajectory(session_id)
        summary = self.catalog.sessions.get(session_id)
        if trajectory is None:
            if summary is None:
                return None
            live = self.catalog.session_status(session_id) if isinstance(self.catalog, RolloutCatalog) else None
            return {"session_id": session_id, "pending": True, "summary": live or summary}
        group = self.group(trajectory.task_id)
        page = pages.session_page(trajectory, summary or {}, group.advantages.get(session_id), self.tokens)
        return {**page, "left_out": group.left_out.get(session_id)}

    def trace(self, session_id: str, trace_id: str) -> dict[str, Any] | None:
        trajectory = self.catalog.trajectory(session_id)
        if trajectory is None:
            return None
        group = self.group(trajectory.task_id)
        page = pages.trace_page(trajectory, trace_id, group.advantages.get(session_id), self.tokens)
        return None if page is None else {**page, "left_out": group.left_out.get(session_id)}


# -------------------------------------------------------------------------------------------- HTTP


def _json(value: Any, status: int = 200) -> web.Response:
    return web.Response(text=pages.dumps(value), status=status, content_type="application/json")


def _not_found(what: str) -> web.Response:
    return _json({"error": f"no {what}"}, status=404)


def _allowed_hosts(host: str, port: int) -> set[str]:
    names = {host, "localhost", "127.0.0.1", "[::1]"} if _is_loopback(host) else {host}
    return {f"{name}:{port}" for name in names} | ({"localhost"} if port == 80 else set())


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def build_app(viewer: Viewer, allowed_hosts: set[str] | None) -> web.Application:
    """The app; `allowed_hosts` (HOST:PORT values of the Host header) is set once the port is known,
    None admits any (a server bound to a wildcard address, by the operator's choice)."""
    hosts: dict[str, set[str] | None] = {"allowed": allowed_hosts}

    @web.middleware
    async def guard(request: web.Request, handler):
        if request.method not in ("GET", "HEAD"):
            return web.Response(status=405, text="polar view is read-only\n", headers={"Allow": "GET, HEAD"})
        allowed = hosts["allowed"]
        if allowed is not None and request.host not in allowed:
            return web.Response(status=421, text="unknown host\n")
        response = await handler(request)
        response.headers["Content-Security-Policy"] = CSP
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "no-referrer"
        response.headers["Cache-Control"] = "no-store"
        return response

    app = web.Application(middlewares=[guard])
    app["hosts"] = hosts
    stopping = asyncio.Event()  # set as the server stops: open event streams end instead of holding it up

    async def stop_streams(app: web.Application) -> None:
        stopping.set()

    app.on_shutdown.append(stop_streams)

    async def blocking(function, *args):
        return await asyncio.get_running_loop().run_in_executor(None, function, *args)

    async def static(request: web.Request) -> web.Response:
        name = request.match_info.get("name", "index.html")
        path = STATIC / name
        if path.suffix not in STATIC_TYPES or path.parent != STATIC or not path.is_file():
            return web.Response(status=404, text="not found\n")
        return web.Response(body=path.read_bytes(), content_type=STATIC_TYPES[path.suffix], charset="utf-8")

    async def overview(request: web.Request) -> web.Response:
        await blocking(viewer.refresh)
        return _json(await blocking(viewer.overview))

    async def step(request: web.Request) -> web.Response:
        try:
            number = int(request.match_info["number"])
        except ValueError:
            return _not_found("such step")
        found = await blocking(viewer.step, number)
        return _json(found) if found else _not_found(f"step {number}")

    async def task(request: web.Request) -> web.Response:
        found = await blocking(viewer.task, request.match_info["task_id"])
        return _json(found) if found else _not_found(f"task {request.match_info['task_id']}")

    async def session(request: web.Request) -> web.Response:
        found = await blocking(viewer.session, request.match_info["session_id"])
        return _json(found) if found else _not_found(f"session {request.match_info['session_id']}")

    async def trace(request: web.Request) -> web.Response:
        found = await blocking(viewer.trace, request.match_info["session_id"], request.match_info["trace_id"])
        return _json(found) if found else _not_found(f"trace {request.match_info['trace_id']}")

    async def events(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store"})
        await response.prepare(request)
        last, quiet_since = "", time.monotonic()
        try:
            while not stopping.is_set():
                await blocking(viewer.refresh)
                stamp = viewer.stamp()
                if stamp != last:
                    await response.write(f"event: changed\ndata: {json.dumps(stamp)}\n\n".encode())
                    last, quiet_since = stamp, time.monotonic()
                elif time.monotonic() - quiet_since > HEARTBEAT_S:
                    await response.write(b": still here\n\n")
                    quiet_since = time.monotonic()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stopping.wait(), EVENT_POLL_S)
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return response

    app.router.add_get("/", static)
    app.router.add_get("/static/{name}", static)
    app.router.add_get("/api/overview", overview)
    app.router.add_get("/api/step/{number}", step)
    app.router.add_get("/api/task/{task_id}", task)
    app.router.add_get("/api/session/{session_id}", session)
    app.router.add_get("/api/session/{session_id}/trace/{trace_id}", trace)
    app.router.add_get("/api/events", events)
    return app


def open_catalog(options: ViewOptions) -> Catalog:
    if options.rollout:
        return RolloutCatalog(options.rollout)
    if options.run_dir is None:
        return EmptyCatalog("nothing to show: give --run-dir DIR (a training run's folder) or --rollout HOST:PORT")
    return StoreCatalog(options.run_dir / ROLLOUT_STORE)


async def _serve(viewer: Viewer, options: ViewOptions) -> None:
    app = build_app(viewer, None)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, options.host, options.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    if _is_loopback(options.host):
        app["hosts"]["allowed"] = _allowed_hosts(options.host, port)
    shown = f"[{options.host}]" if ":" in options.host else options.host
    print(f"polar view: serving http://{shown}:{port}/ ({viewer.catalog.source}); Ctrl-C stops it", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def run_view(options: ViewOptions) -> int:
    catalog = open_catalog(options)
    try:
        viewer = Viewer(options, catalog)
        viewer.refresh()
        if not _is_loopback(options.host):
            print(
                f"polar view: warning: listening on {options.host}: anyone who reaches it reads every session",
                file=sys.stderr,
                flush=True,
            )
        asyncio.run(_serve(viewer, options))
    finally:
        catalog.close()
    return 0
