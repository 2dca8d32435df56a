"""Credentials issued to other machines by name (polar.credentials): only hashes are kept, a file
changed by `polar credentials` is read again by the server that watches it, a revoked token is
nobody, an inference server admits what its control plane told it, and the stack's own node token
is refused from an address that is not this machine's."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from polar import credentials
from polar.app.cli import main
from polar.grpc_server import peer_is_this_machine


def bearer(token: str) -> str:
    return f"Bearer {token}"


def test_an_issued_token_is_its_name_and_role_until_revoked(tmp_path: Path) -> None:
    own = credentials.ensure(tmp_path / "credentials")
    path = credentials.issued_path(own.folder)
    own.issued.watch(path)
    token = credentials.issue(path, "gpu-1", credentials.INFERENCE)
    other = credentials.issue(path, "node-b", credentials.NODE)
    assert own.caller_of(bearer(token)) == credentials.Caller(credentials.INFERENCE, "gpu-1")
    assert own.caller_of(bearer(other)) == credentials.Caller(credentials.NODE, "node-b")
    assert own.caller_of(bearer(own.tokens["node"])) == credentials.Caller(credentials.NODE, "")
    # Only hashes are kept, in a private file.
    assert token not in path.read_text() and stat.S_IMODE(path.stat().st_mode) == 0o600
    credentials.revoke(path, "gpu-1")
    assert own.caller_of(bearer(token)) is None  # the watched file is read again at once
    assert own.caller_of(bearer(other)) == credentials.Caller(credentials.NODE, "node-b")
    with pytest.raises(credentials.IssuedError, match="no credential named 'gpu-1'"):
        credentials.revoke(path, "gpu-1")
    with pytest.raises(credentials.IssuedError, match="issued already"):
        credentials.issue(path, "node-b", credentials.NODE)
    with pytest.raises(credentials.IssuedError, match="role 'operator'"):
        credentials.issue(path, "x", credentials.OPERATOR)
    with pytest.raises(credentials.IssuedError, match="name '../x'"):
        credentials.issue(path, "../x", credentials.NODE)


def test_an_inference_server_admits_what_its_control_plane_told_it(tmp_path: Path) -> None:
    rollout = credentials.ensure(tmp_path / "a")
    path = credentials.issued_path(rollout.folder)
    rollout.issued.watch(path)
    node_token = credentials.issue(path, "node-b", credentials.NODE)
    gpu_token = credentials.issue(path, "gpu-c", credentials.INFERENCE)
    machine = credentials.load(credentials.write_token(tmp_path / "c", credentials.INFERENCE, gpu_token).parent)
    assert machine.tokens == {credentials.INFERENCE: gpu_token}
    assert machine.caller_of(bearer(node_token)) is None
    machine.issued.learn(rollout.accepted())
    assert machine.caller_of(bearer(node_token)) == credentials.Caller(credentials.NODE, "node-b")
    assert machine.caller_of(bearer(rollout.tokens["trainer"])) == credentials.Caller(credentials.TRAINER, "")
    # Inference credentials are not told: nothing calls an inference server as one.
    assert {entry.name for entry in rollout.accepted() if entry.name} == {"node-b"}


def test_a_machine_without_its_credential_is_told_how_to_get_one(tmp_path: Path) -> None:
    with pytest.raises(credentials.CredentialsError, match="polar credentials issue NAME node --out DIR"):
        credentials.for_machine("node", tmp_path / "empty")
    credentials.write_token(tmp_path / "b", credentials.NODE, "ab" * 32)
    assert credentials.for_machine("node", tmp_path / "b").tokens == {"node": "ab" * 32}
    assert credentials.call_role(credentials.for_machine("inference", tmp_path / "b"), credentials.INFERENCE) == "node"


def test_the_credentials_commands_issue_list_and_revoke(tmp_path: Path, monkeypatch, capsys) -> None:
    folder = tmp_path / "credentials"
    monkeypatch.setenv(credentials.ENV_VAR, str(folder))
    assert main(["credentials", "issue", "node-b", "node", "--out", str(tmp_path / "b")]) == 0
    written = tmp_path / "b" / "node"
    assert stat.S_IMODE(written.stat().st_mode) == 0o600 and str(written) in capsys.readouterr().out
    assert main(["credentials", "issue", "gpu-c", "inference"]) == 0
    printed = capsys.readouterr().out.strip()
    assert len(printed) == 64
    assert main(["credentials", "list"]) == 0
    listing = capsys.readouterr().out
    assert "node-b" in listing and "gpu-c" in listing and printed not in listing
    assert main(["credentials", "revoke", "node-b"]) == 0
    assert [e["name"] for e in json.loads((folder / "issued.json").read_text())["credentials"]] == ["gpu-c"]
    assert main(["credentials", "revoke", "node-b"]) == 1
    assert "no credential named 'node-b'" in capsys.readouterr().err


def test_the_peer_check_knows_this_machine_from_others() -> None:
    assert peer_is_this_machine("ipv4:127.0.0.1:5000")
    assert peer_is_this_machine("ipv4:127.0.0.2:5000")
    assert peer_is_this_machine("ipv6:[::1]:5000")
    assert peer_is_this_machine("unix:/tmp/x.sock")
    assert not peer_is_this_machine("ipv4:192.0.2.7:5000")  # TEST-NET-1: never this machine's
