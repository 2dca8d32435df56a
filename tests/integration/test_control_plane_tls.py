"""TLS on the control plane between machines: the rollout server's TLS listener (grpc's own TLS,
a certificate of a CA made here), beside its plaintext one for this machine's own services. An
inference server joins over it, a real Envoy takes its endpoints over ADS through it, and a client
without TLS, or trusting another CA, is not served. Every wait is bounded."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from polar import credentials, envoy
from polar.config import EnvoyConfig, RolloutConfig
from polar.rollout.server import RunningRollout, start_rollout_server
from polar.service_base import ServiceError
from polar.v1 import rollout_pb2, rollout_pb2_grpc
from polar.xds.member import UpstreamMember
from polar.xds.snapshot import INFERENCE_CLUSTER

pytestmark = pytest.mark.anyio

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402

WAIT_S = 15.0
ENVOY_ID = "envoy-tls"


def _name(text: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, text)])


def make_ca(folder: Path, name: str) -> tuple[Path, ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    path = folder / f"{name}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path, key, cert


def make_server_cert(folder: Path, ca_key, ca_cert, ip: str) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("rollout"))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = folder / "server.pem", folder / "server.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


@contextlib.asynccontextmanager
async def tls_rollout(tmp_path: Path) -> AsyncIterator[tuple[RunningRollout, Path]]:
    ca, ca_key, ca_cert = make_ca(tmp_path, "polar-test-ca")
    cert, key = make_server_cert(tmp_path, ca_key, ca_cert, "127.0.0.1")
    config = RolloutConfig(
        host="127.0.0.1",
        port=0,
        store=str(tmp_path / "rollout.db"),
        heartbeat_interval_s=0.2,
        node_timeout_s=1.0,
        tls_address="127.0.0.1:0",
        tls_cert=str(cert),
        tls_key=str(key),
    )
    running = await start_rollout_server(config)
    try:
        yield running, ca
    finally:
        await running.stop(grace=0.5)


async def list_upstreams(address: str, tls_ca: str = "") -> rollout_pb2.ListUpstreamsResponse:
    async with credentials.aio_channel(address, tls_ca) as channel:
        return await rollout_pb2_grpc.RolloutServiceStub(channel).ListUpstreams(
            rollout_pb2.ListUpstreamsRequest(), timeout=5
        )


async def test_machines_reach_the_control_plane_over_tls_and_plaintext_stays_for_this_machine(tmp_path):
    async with tls_rollout(tmp_path) as (rollout, ca):
        assert rollout.tls_port and rollout.tls_port != rollout.port
        tls_address = f"127.0.0.1:{rollout.tls_port}"
        member = UpstreamMember(tls_address, INFERENCE_CLUSTER, "127.0.0.5:7001", tls_ca=str(ca))
        await member.start(timeout_s=WAIT_S)
        try:
            # The plaintext listener (this machine's services) sees what joined over TLS.
            assert [u.address for u in (await list_upstreams(rollout.address)).upstreams] == ["127.0.0.5:7001"]
            assert [u.address for u in (await list_upstreams(tls_address, str(ca))).upstreams] == ["127.0.0.5:7001"]
            # Plaintext to the TLS listener, or TLS trusting another CA: not served.
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await list_upstreams(tls_address)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            other_ca, _, _ = make_ca(tmp_path, "another-ca")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await list_upstreams(tls_address, str(other_ca))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

            # A real Envoy on the control plane over TLS gets and acknowledges its endpoints.
            config = EnvoyConfig(
                harness_port=0,
                inference_port=0,
                admin_port=0,
                workers=1,
                xds_address=tls_address,
                xds_tls_ca=str(ca),
                node_id=ENVOY_ID,
            )
            async with envoy.running_async(config) as proxy:
                deadline = time.monotonic() + WAIT_S
                while True:
                    envoys = {e.node_id: e for e in (await list_upstreams(rollout.address)).envoys}
                    mine = envoys.get(ENVOY_ID)
                    if mine is not None and mine.version and mine.acknowledged_version == mine.version:
                        break
                    assert time.monotonic() < deadline, "Envoy did not acknowledge a version over TLS"
                    await asyncio.sleep(0.05)
                dump = envoy.admin_get(proxy.admin, "/config_dump?include_eds", timeout_s=5)
                assert '"port_value": 7001' in dump and '"address": "127.0.0.5"' in dump
        finally:
            await member.leave()


async def test_tls_settings_that_cannot_serve_are_one_clear_error(tmp_path):
    for settings, needle in (
        ({"tls_address": "127.0.0.1:0"}, "tls_cert, tls_key not set"),
        (
            {
                "tls_address": "127.0.0.1:0",
                "tls_cert": str(tmp_path / "none.pem"),
                "tls_key": str(tmp_path / "none.key"),
            },
            "cannot read",
        ),
    ):
        with pytest.raises(ServiceError, match=needle):
            await start_rollout_server(
                RolloutConfig(host="127.0.0.1", port=0, store=str(tmp_path / "r.db"), **settings)
            )
    with pytest.raises(credentials.CredentialsError, match="cannot read the TLS CA certificate"):
        UpstreamMember("127.0.0.1:1", INFERENCE_CLUSTER, "127.0.0.1:2", tls_ca=str(tmp_path / "missing.pem"))
