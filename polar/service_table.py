"""Every service Polar runs, one `Service` row each (see polar.service_base): its name, its config
sections (polar/config.py), its health-checked gRPC service and the function that serves it.

`polar serve NAME` (polar.app.cli) and `polar up`'s command lines (polar.app.stack) both come from these rows;
a new service is a config dataclass plus one row here (and, to start it in `polar up`, one line in
`polar.app.stack.plan`).
"""

from __future__ import annotations

from polar.config import (
    EnvoyConfig,
    GatewayConfig,
    InferenceConfig,
    NodeConfig,
    RolloutConfig,
    TrainerConfig,
    XdsConfig,
)
from polar.service_base import Flag, Service, join_host_port
from polar.v1 import gateway_pb2, inference_pb2, rollout_pb2, trainer_pb2

INFERENCE_SERVICE = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name
GATEWAY_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name
ROLLOUT_SERVICE = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"].full_name
TRAINER_SERVICE = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name

# Addresses of other services keep their short flags.
_INFERENCE = Flag(
    "--inference",
    "inference_address",
    "gRPC address of the inference service (or Envoy's inference listener)",
    {"required": True, "metavar": "HOST:PORT"},
)
_ROLLOUT = Flag(
    "--rollout",
    "rollout_address",
    "the rollout server to work for (default: %(default)s)",
    {"default": join_host_port(RolloutConfig().host, RolloutConfig().port), "metavar": "HOST:PORT"},
)

INFERENCE = Service(
    "inference",
    "serve a model over gRPC (InferenceService)",
    (InferenceConfig,),
    INFERENCE_SERVICE,
    "polar.inference.server:serve_inference",
    flags=(
        Flag(
            "--rollout",
            "rollout_address",
            "the rollout server whose control plane this server joins (Envoys send to it within a second); default: none",
            {"default": "", "metavar": "HOST:PORT"},
        ),
    ),
)
ENVOY = Service(
    "envoy",
    "run Envoy in front of the gateway and the inference servers",
    (EnvoyConfig,),
    INFERENCE_SERVICE,
    "polar.envoy:serve",
    flags=(
        Flag(
            "--inference",
            "inference",
            "an inference server; repeat for several (calls of one session stay on one server); not with --xds",
            {"action": "append", "metavar": "HOST:PORT"},
        ),
        Flag("--gateway", "gateway", "the gateway's HTTP address; not with --xds", {"metavar": "HOST:PORT"}),
        Flag(
            "--xds",
            "xds_address",
            "the control plane (a rollout server): Envoy learns inference servers and gateways from it as they join",
            {"default": "", "metavar": "HOST:PORT"},
        ),
    ),
)
GATEWAY = Service(
    "gateway",
    "serve the API dialects over HTTP and GatewayService over gRPC",
    (GatewayConfig,),
    GATEWAY_SERVICE,
    "gateway.server:serve_gateway",
    flags=(_INFERENCE,),
    takes_http_socket=True,
)
ROLLOUT = Service(
    "rollout",
    "serve the RolloutService: tasks, dispatch to nodes, results",
    (RolloutConfig,),
    ROLLOUT_SERVICE,
    "polar.rollout.server:serve_rollout",
)
XDS = Service(
    "xds",
    "serve Envoy's control plane alone (ADS; upstreams join it), apart from the rollout server",
    (XdsConfig,),
    ROLLOUT_SERVICE,
    "polar.xds.service:serve_xds",
)
NODE = Service(
    "node",
    "run a gateway node: the gateway plus the pools that run sessions",
    (NodeConfig, GatewayConfig),
    GATEWAY_SERVICE,
    "polar.app.node.node:serve_node",
    flags=(_INFERENCE, _ROLLOUT),
    takes_http_socket=True,
)

TRAINER = Service(
    "trainer",
    "train the policy with GRPO on the rollout server's groups (TrainerService)",
    (TrainerConfig,),
    TRAINER_SERVICE,
    "trainer.service:serve_trainer",
    flags=(
        _ROLLOUT,
        Flag(
            "--inference",
            "inference",
            "an inference server to keep in sync; repeat for every one (not Envoy: each gets the weights)",
            {"action": "append", "required": True, "metavar": "HOST:PORT"},
        ),
    ),
)

SERVICES: tuple[Service, ...] = (INFERENCE, ENVOY, GATEWAY, ROLLOUT, XDS, NODE, TRAINER)
