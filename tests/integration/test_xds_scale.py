"""Scaling out behind the real Envoy, each "machine" on its own loopback address with its own
processes: the control plane (the rollout server) on 127.0.0.1, scripted inference servers on
127.0.0.2, .3 and .4 (each `polar serve inference --rollout`, joining the control plane as a stack's
does), Envoy on 127.0.0.5. While the set is stable every call of a session reaches one server; when a
third server starts and joins under load (512 sessions calling all along) no call fails, the new
server takes about a third of new sessions, and most sessions already placed stay where they were.
Every wait is bounded."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import grpc
import pytest

from polar import envoy
from polar.config import RolloutConfig
from polar.rollout.server import start_rollout_server
from polar.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from tests.helpers.polar_command import Lines, spawned
from tests.helpers.waiting import WAIT_S, until
from tests.helpers.xds_machines import ENVOY_HOST, envoy_on, health_flags, inference_machine, joined

pytestmark = pytest.mark.anyio

# Sessions placed before the third server joins, and new ones after: 512 each, so that the shares
# measured are within a few points of the true ones (Maglev keeps 2/3 of the placed sessions).
SESSIONS = 512
HOSTS = {"a": "127.0.0.2", "b": "127.0.0.3", "c": "127.0.0.4"}
TOKEN = {"a": 11, "b": 21, "c": 31}  # what each server answers: who served a call


def scripted_machine(start, folder: Path, name: str, rollout: str) -> Lines:
    """Machine `name`'s inference server, answering TOKEN[name]; its output lines."""
    script = {
        "tokenizer": None,
        "vocab_size": 100,
        "cycle": True,
        "outputs": [{"token_ids": [TOKEN[name]], "logprobs": [-0.1]}],
    }
    return inference_machine(start, folder, name, HOSTS[name], script, rollout)[1]


class Load:
    """Calls through Envoy, one session's at a time, counting failures and who served each."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = inference_pb2_grpc.InferenceServiceStub(self.channel)
        self.failures: list[str] = []
        self.calls = 0

    async def call(self, session: str) -> str:
        request = inference_pb2.GenerateRequest(
            prompt_token_ids=[1, 2, 3], sampling=common_pb2.SamplingParams(max_tokens=1)
        )
        try:
            tokens = [
                t
                async for m in self.stub.Generate(request, metadata=(("x-polar-session", session),), timeout=10)
                for t in m.token_ids
            ]
        except grpc.aio.AioRpcError as exc:
            self.failures.append(f"{session}: {exc.code().name}: {exc.details()}")
            return "failed"
        self.calls += 1
        return next(name for name, token in TOKEN.items() if tokens == [token])

    async def sessions(self, names: list[str]) -> dict[str, str]:
        """One call of each session, all at once; the server of each."""
        served = await asyncio.gather(*(self.call(name) for name in names))
        return dict(zip(names, served))


def healthy_hosts(proxy: envoy.RunningEnvoy) -> set[str]:
    return {address.rsplit(":", 1)[0] for address, flags in health_flags(proxy).items() if flags == "healthy"}


async def test_sessions_stay_on_their_server_and_a_joining_server_takes_a_third_of_new_ones(tmp_path):
    # No server leaves here: a node timeout well above a loaded machine's heartbeat delays.
    config = RolloutConfig(
        host="127.0.0.1", port=0, store=str(tmp_path / "r.db"), heartbeat_interval_s=0.2, node_timeout_s=10.0
    )
    rollout = await start_rollout_server(config)
    try:
        with spawned() as start:
            a, b = (scripted_machine(start, tmp_path, name, rollout.address) for name in "ab")
            async with envoy_on(rollout.address, "envoy-scale") as proxy:
                await asyncio.gather(joined(a, HOSTS["a"]), joined(b, HOSTS["b"]))
                await until("Envoy sends to a and b", lambda: healthy_hosts(proxy) == {HOSTS["a"], HOSTS["b"]})
                load = Load(f"{ENVOY_HOST}:{proxy.inference_port}")
                placed = [f"placed-{i}" for i in range(SESSIONS)]

                # Affinity: while the set is stable, every call of a session reaches one server.
                rounds = [await load.sessions(placed) for _ in range(3)]
                assert rounds[0] == rounds[1] == rounds[2]
                before = rounds[0]
                assert set(before.values()) == {"a", "b"}

                # Under load: the placed sessions keep calling while c starts and joins.
                ready = asyncio.Event()

                async def keep_calling() -> list[dict[str, str]]:
                    seen = []
                    while not ready.is_set():
                        seen.append(await load.sessions(placed))
                    return seen

                during = asyncio.create_task(keep_calling())
                await asyncio.sleep(0.2)
                await joined(scripted_machine(start, tmp_path, "c", rollout.address), HOSTS["c"])
                await until("Envoy sends to c too", lambda: HOSTS["c"] in healthy_hosts(proxy))
                ready.set()
                await asyncio.wait_for(during, WAIT_S)

                after = await load.sessions(placed)
                stayed = sum(after[s] == before[s] for s in placed) / SESSIONS
                assert stayed >= 0.6, f"only {stayed:.0%} of placed sessions stayed"
                # A session that moved went, nearly always, to the new server: Maglev's table moves a
                # few entries between the old servers too when one joins (its disruption is small,
                # not zero).
                between_old = sum(after[s] not in (before[s], "c") for s in placed)
                assert between_old <= 0.05 * SESSIONS, (
                    f"{between_old} of {SESSIONS} sessions moved between the old servers"
                )
                fresh = await load.sessions([f"new-{i}" for i in range(SESSIONS)])
                share = Counter(fresh.values())
                assert 0.25 <= share["c"] / SESSIONS <= 0.42, (
                    f"the new server took {share['c']} of {SESSIONS} new sessions"
                )
                assert not load.failures, load.failures[:5]
                assert load.calls >= 6 * SESSIONS
                await load.channel.close()
    finally:
        await rollout.stop(grace=0.5)
