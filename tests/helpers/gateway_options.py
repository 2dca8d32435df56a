"""What a test module's `gateway` fixture (tests/conftest.py) runs: the module overrides the
`gateway_options` fixture with a GatewayOptions of its own."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from polar.inference.engines.base import Engine


@dataclass
class GatewayOptions:
    """running_gateway's arguments (polar.testing.gateway: a scripted model's `script`, or an
    `engine`, which the gateway stops unless `stop_engine` is false: an engine the session
    shares; `envoy`), and `clients`, the module's own list of the HTTP
    and SDK clients its tests open. They are closed after its last test, while the gateway still
    runs: left to the garbage collector, their connections would close at some later moment, inside
    whichever test runs then, and could fail it."""

    script: Mapping[str, Any] | None = None
    engine: Engine | None = None
    envoy: bool = True
    stop_engine: bool = True
    clients: list = field(default_factory=list)


async def close_client(client: Any) -> None:
    """An httpx client closes with `aclose`, an SDK's client with `close`."""
    await (client.aclose() if hasattr(client, "aclose") else client.close())
