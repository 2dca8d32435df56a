"""The whole training loop, measured: `polar train` for a few steps in each trace mode, side by side.

Each mode is one `polar train` run (the rollout server, the torch inference server, Envoy, a gateway
node and the trainer, as a user runs them) over the same tasks, for --steps steps:

- per_request: one trace per call (the builder "per_request"), each trace packed alone;
- prefix_merging: calls whose prompts extend one another merged into one trace;
- prefix_merging+packing: merged, and traces that begin with the same prompt (a CLI's system prompt)
  packed as a tree whose shared prompt is computed once ([trainer] share_prefixes).

The sessions keep the shape of the recorded CLI sessions (tests/fixtures/sessions: Claude Code's and
Pi's): each replays its recording's first request as the real CLI sent it (system prompt, tools,
instruction), then for every later call sends the conversation so far, the model's own reply
included, plus the tool output the recording had there, with max tokens the recorded reply's length:
so calls per session, prompt and reply sizes and tool results are the recording's, and later calls
extend earlier ones as a CLI's do. The recordings are short (two calls each), so one trace per call
costs at most twice a merged one there; `--turns coding` keeps each recording's first request and
then makes twelve calls of a coding session's sizes (replies ~150 tokens, tool results ~300), the
shape the published comparison of trace modes measured. This script is the harness (`--replay
SHAPE`) and the evaluator (`--score`: the share of the last reply's characters that are lowercase
letters, so rewards vary and every group trains).

Reported per mode and per step: wall clock (the trainer's), time waiting for rollouts, training,
syncing weights, and the rest; tokens generated (the calls' sampled tokens) and trained (computed by
the trainer), each per second of the mode's wall clock; and, on GPUs, the busy fraction of each card
used (NVML utilisation, sampled every 0.1 s from the first step's start to the last step's end) and
their mean, that of each side (inference server and trainer, from NVML's per-process samples of its
processes on its own GPU, where the driver keeps them), and each side's peak memory. The JSON written
to --out holds one entry per mode under `modes`, each with `wall_s`, its busy fractions and `gpus`
(each card's busy fraction and each side's memory on it), and `ratios`, each mode's wall clock over
prefix_merging's; `settings` and `machine` say which device each side ran on.

    python scripts/bench_loop.py --device cpu --quick       # tiny model, Pi's sessions: minutes on 2 cores
    python scripts/bench_loop.py --device cuda              # a Qwen3-shaped model with random weights
    python scripts/bench_loop.py --device cuda --harnesses claude-code --turns coding
    python scripts/bench_loop.py --device cuda:0 --trainer-device cuda:1   # a GPU for each service

On cuda both services share one GPU, taking turns (no group is sampled while the trainer steps; the
engine gives its keys and values back while idle, the trainer its activations after each update),
unless --trainer-device names another: the inference server on --device's GPU, the trainer on its
own, and each weight push crossing between them (CUDA IPC: the server opens the trainer's buffers on
the trainer's GPU and copies them to its own, peer to peer). The model is Qwen3-0.6B-shaped (--shape
qwen3-4b for Qwen3-4B's), with SmolLM2's tokenizer and vocabulary, random weights: the cost is
measured, not what is learned.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import benchmark_common

MODES = {
    "per_request": {"builder": "per_request", "share_prefixes": False},
    "prefix_merging": {"builder": "prefix_merging", "share_prefixes": False},
    "prefix_merging+packing": {"builder": "prefix_merging", "share_prefixes": True},
}
SHAPES = benchmark_common.QWEN3_SHAPES
SCRIPT = Path(__file__).resolve()
RUN_TIMEOUT_S = 1800.0
# --turns coding: calls a session makes. A coding agent's sessions run to dozens of calls; at twelve,
# one trace per call trains the first prompt twelve times against once merged.
CODING_CALLS = 12
NVML_INTERVAL_S = 0.1
GIB = 1 << 30


# ------------------------------------------------------------------------------ the harness and the evaluator


def session_shape(harness: str, turns: str = "recorded") -> dict:
    """What a replay needs of a recorded session, in plain JSON (the harness runs without Polar): its
    dialect's path, the first request's body, and for each later call the tool output it added and
    each call's reply length. `turns` "coding": the recorded first request, then the turns of a coding
    session instead of the recording's (coding_turns)."""
    from polar.trajectory.session_file import read_trajectory
    from polar.v1 import common_pb2

    calls = read_trajectory(benchmark_common.RECORDED_SESSIONS / f"{harness}.json.zst").calls
    bodies = [json.loads(call.request_body) for call in calls]
    anthropic = calls[0].dialect == common_pb2.DIALECT_ANTHROPIC_MESSAGES
    if not anthropic and calls[0].dialect != common_pb2.DIALECT_OPENAI_CHAT:
        raise SystemExit(f"{harness}: only Anthropic Messages and Chat Completions sessions are replayed")
    added = []
    for before, after in zip(bodies, bodies[1:]):
        new = [m for m in after["messages"][len(before["messages"]) :] if m.get("role") != "assistant"]
        added.append("\n".join(_text_of(m.get("content")) for m in new))
    reply_tokens = [max(1, len(call.sampled_token_ids)) for call in calls]
    if turns == "coding":
        reply_tokens, added = coding_turns(json.dumps(bodies[0]))
    return {
        "harness": harness,
        "anthropic": anthropic,
        "first": bodies[0],
        "tool_outputs": added,
        "reply_tokens": reply_tokens,
    }


def coding_turns(text: str, seed: int = 0) -> tuple[list[int], list[str]]:
    """A coding session's calls after its first: CODING_CALLS calls, each reply's max tokens and each
    tool result's length drawn log-normal around what coding sessions send (replies of ~150 tokens,
    tool results of ~300: scripts/bench_shared_prefix.py's "coding" shape), the results cut from
    `text` (about 4 characters a token). Returns each call's max tokens and the tool result each later
    call adds."""
    rng = random.Random(seed)

    def drawn(median: float, low: int, high: int) -> int:
        return int(min(high, max(low, rng.lognormvariate(math.log(median), 0.8))))

    replies = [drawn(150, 10, 1500) for _ in range(CODING_CALLS)]
    results = []
    for _ in range(CODING_CALLS - 1):
        length = 4 * drawn(300, 20, 3000)
        start = rng.randrange(max(1, len(text) - length))
        results.append(text[start : start + length])
    return replies, results


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_text_of(block.get("text", block.get("content", ""))) for block in content)
    return ""


def replay(shape_file: str) -> int:
    """The harness: the recorded session's calls, each extending the conversation with the model's reply."""
    shape = json.loads(Path(shape_file).read_text())
    anthropic = shape["anthropic"]
    body = dict(shape["first"])
    body["stream"] = False
    body.pop("stream_options", None)
    messages = list(body["messages"])
    reply = ""
    for call, max_tokens in enumerate(shape["reply_tokens"]):
        if call:
            tool_output = shape["tool_outputs"][call - 1]
            if anthropic:
                messages.append({"role": "assistant", "content": [{"type": "text", "text": reply or "."}]})
                messages.append({"role": "user", "content": [{"type": "text", "text": tool_output}]})
            else:
                messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": tool_output}]
        body["messages"] = messages
        body["max_tokens" if anthropic else "max_completion_tokens"] = max_tokens
        answer = _post("/v1/messages" if anthropic else "/v1/chat/completions", body)
        if anthropic:
            reply = "".join(block.get("text", "") for block in answer.get("content", []))
        else:
            reply = answer["choices"][0]["message"].get("content") or ""
    Path("answer.txt").write_text(reply)
    return 0


def _post(path: str, body: dict) -> dict:
    key = os.environ["POLAR_SESSION_KEY"]
    request = urllib.request.Request(
        os.environ["POLAR_BASE_URL"].rstrip("/") + path,
        data=json.dumps(body).encode(),
        headers={
            "Content-Type": "application/json",
            "Authorization": f"Bearer {key}",
            "x-api-key": key,
            "anthropic-version": "2023-06-01",
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.load(response)
    except urllib.error.HTTPError as error:
        # The gateway's answer says why: the session's failure in the report carries it.
        raise SystemExit(f"{path}: HTTP {error.code}: {error.read().decode(errors='replace')[:2000]}") from None


def score() -> int:
    """The evaluator: the share of answer.txt's characters that are ASCII lowercase letters."""
    try:
        text = Path("answer.txt").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        text = ""
    print(sum("a" <= ch <= "z" for ch in text) / len(text) if text else 0)
    return 0


# ------------------------------------------------------------------------------------------ GPU sampling


@dataclass
class GpuSamples:
    """NVML readings of the GPUs a mode uses (by index), while it runs: each GPU's utilisation, and
    per process on it the SM utilisation samples and the largest memory seen."""

    device: dict[int, list[tuple[float, float]]] = field(default_factory=dict)  # gpu -> (time, utilisation 0..1)
    processes: dict[tuple[int, int], list[tuple[float, float]]] = field(default_factory=dict)  # (gpu, pid) -> samples
    memory: dict[tuple[int, int], int] = field(default_factory=dict)  # (gpu, pid) -> bytes
    sides: dict[int, str] = field(default_factory=dict)  # pid -> "inference" or "trainer"

    def busy(self, gpu: int | None, start: float, end: float, side: str = "") -> float:
        """The mean utilisation of `gpu` from start to end: the device's, or with `side` that of its
        processes on that GPU; NaN without samples (`gpu` None: the CPU)."""
        if side:
            samples = [s for (g, pid), s in self.processes.items() if g == gpu and self.sides.get(pid) == side]
        else:
            samples = [self.device.get(gpu, [])]
        values = [u for series in samples for t, u in series if start <= t <= end]
        return sum(values) / len(values) if values else float("nan")

    def memory_gib(self, side: str, gpu: int | None = None) -> float:
        """The peak memory of `side`'s processes on `gpu`, or on every GPU sampled; NaN when nothing was."""
        if not self.memory:
            return float("nan")
        return sum(b for (g, pid), b in self.memory.items() if self.sides.get(pid) == side and gpu in (None, g)) / GIB


class NvmlSampler:
    """Samples the GPUs `gpus` (NVML indices) in a thread until stopped; nothing where there are none
    or NVML is missing."""

    def __init__(self, gpus: list[int]) -> None:
        self.samples = GpuSamples()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml = None
        self._handles: dict[int, object] = {}
        if not gpus:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handles = {gpu: pynvml.nvmlDeviceGetHandleByIndex(gpu) for gpu in gpus}
            self._nvml = pynvml
        except Exception:
            pass

    def __enter__(self) -> GpuSamples:
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self.samples

    def __exit__(self, *_) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        last_seen = dict.fromkeys(self._handles, 0)
        while not self._stop.wait(NVML_INTERVAL_S):
            now = time.monotonic()
            for gpu, handle in self._handles.items():
                last_seen[gpu] = self._sample(gpu, handle, now, last_seen[gpu])

    def _sample(self, gpu: int, handle, now: float, last_seen: int) -> int:
        """One reading of `gpu`; returns the timestamp of the newest per-process sample read so far."""
        nvml, samples = self._nvml, self.samples
        samples.device.setdefault(gpu, []).append((now, nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100))
        try:
            for process in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if process.pid not in samples.sides:
                    samples.sides[process.pid] = _side(process.pid)
                key = (gpu, process.pid)
                samples.memory[key] = max(samples.memory.get(key, 0), process.usedGpuMemory or 0)
        except nvml.NVMLError:
            pass
        try:
            for sample in nvml.nvmlDeviceGetProcessUtilization(handle, last_seen):
                last_seen = max(last_seen, sample.timeStamp)
                samples.processes.setdefault((gpu, sample.pid), []).append((now, sample.smUtil / 100))
        except nvml.NVMLError:
            pass
        return last_seen


def _side(pid: int) -> str:
    """Which service a GPU process is, by its command line (`polar serve inference|trainer`)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return ""
    for side in ("inference", "trainer"):
        if b"serve" in argv and side.encode() in argv:
            return side
    return ""


# ------------------------------------------------------------------------------------------ one mode


@dataclass
class ModeResult:
    mode: str
    wall_s: float  # the trainer's wall clock over the steps
    startup_s: float  # from `polar train` to the trainer serving
    steps: list[dict]
    tokens_generated: int
    tokens_trained: int
    gpu_busy_fraction: float
    inference_busy_fraction: float
    trainer_busy_fraction: float
    inference_memory_gib: float
    trainer_memory_gib: float
    gpus: dict[str, dict]  # each GPU used ("cuda:N"): its busy fraction and each side's memory on it

    def report(self) -> dict:
        seconds = {key: sum(step[key] for step in self.steps) for key in ("rollout_wait_s", "train_s", "weight_sync_s")}
        return {
            "wall_s": self.wall_s,
            "startup_s": self.startup_s,
            **seconds,
            "other_s": self.wall_s - sum(seconds.values()),
            "tokens_generated": self.tokens_generated,
            "tokens_trained": self.tokens_trained,
            "generated_tokens_per_s": self.tokens_generated / self.wall_s if self.wall_s else float("nan"),
            "trained_tokens_per_s": self.tokens_trained / self.wall_s if self.wall_s else float("nan"),
            "gpu_busy_fraction": self.gpu_busy_fraction,
            "inference_busy_fraction": self.inference_busy_fraction,
            "trainer_busy_fraction": self.trainer_busy_fraction,
            "inference_memory_gib": self.inference_memory_gib,
            "trainer_memory_gib": self.trainer_memory_gib,
            "gpus": self.gpus,
            "steps": self.steps,
        }


def write_tasks(path: Path, shapes: list[Path], builder: str, groups: int, group_size: int) -> None:
    lines = []
    for i in range(groups):
        shape = shapes[i % len(shapes)]
        lines.append(
            {
                "taskId": f"{shape.stem}-{i}",
                "instruction": "Replay the recorded session.",
                "groupSize": group_size,
                "builder": builder,
                "harness": {"preset": "command", "command": [sys.executable, str(SCRIPT), "--replay", str(shape)]},
                "runtime": {"kind": "local"},
                "evaluator": {"kind": "command", "command": f"{sys.executable} {SCRIPT} --score"},
                "sampling": {"temperature": 1.0, "topP": 1.0},
                "timeoutSeconds": 900,
            }
        )
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def write_config(path: Path, tasks: Path, model: str, args: argparse.Namespace, share_prefixes: bool) -> None:
    sections = {
        "rollout": {"port": 0},
        "inference": {"port": 0, "device": args.device, "max_batch_size": args.max_batch_size},
        "envoy": {"harness_port": 0, "inference_port": 0, "admin_port": 0},
        "gateway": {"port": 0, "grpc_port": 0},
        "node": {"running_slots": args.group_size * 2, "ready_slots": args.group_size},
        "trainer": {
            "port": 0,
            "model": model,
            "device": args.trainer_device,
            "dataset": str(tasks),
            "steps": args.steps,
            "groups_per_step": args.groups_per_step,
            # On one GPU the two services take turns, as colocated trainers do: no group is sampled
            # while the trainer steps, so the engine's cache and the trainer's activations never
            # need the card at once.
            "groups_ahead": 0 if args.device == args.trainer_device != "cpu" else 1,
            "lr": 1e-5,
            "seed": 0,
            "checkpoint_every": args.steps + 1,
            "share_prefixes": share_prefixes,
        },
    }
    path.write_text(
        "".join(
            f"[{name}]\n" + "".join(f"{key} = {json.dumps(value)}\n" for key, value in keys.items())
            for name, keys in sections.items()
        )
    )


def run_mode(mode: str, model: str, shapes: list[Path], work: Path, args: argparse.Namespace) -> ModeResult:
    folder = work / mode.replace("+", "_")
    folder.mkdir()
    settings = MODES[mode]
    tasks = folder / "tasks.jsonl"
    write_tasks(tasks, shapes, settings["builder"], args.steps * args.groups_per_step + 2, args.group_size)
    config = folder / "train.toml"
    write_config(config, tasks, model, args, settings["share_prefixes"])
    run_dir = folder / "run"
    command = [sys.executable, "-m", "polar", "train", str(config), "--run-dir", str(run_dir)]
    home = {"inference": gpu_index(args.device), "trainer": gpu_index(args.trainer_device)}
    gpus = sorted({gpu for gpu in home.values() if gpu is not None})
    started = time.monotonic()
    serving = first_step = last_step = None
    output: list[str] = []
    with NvmlSampler(gpus) as samples:
        process = subprocess.Popen(
            command, cwd=benchmark_common.ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        timer = threading.Timer(RUN_TIMEOUT_S, process.kill)
        timer.start()
        try:
            for line in process.stdout:
                output.append(line)
                if serving is None and re.match(r"^  trainer +\S+:\d+ ", line):
                    serving = time.monotonic()
                if re.search(r"\] step \d+/", line):
                    last_step = time.monotonic()
                if args.verbose:
                    print(f"  [{mode}] {line}", end="", flush=True)
            code = process.wait()
        finally:
            timer.cancel()
        ended = time.monotonic()
    if code != 0:
        raise SystemExit(f"bench_loop: {mode}: polar train exited with {code}:\n" + "".join(output[-40:]))
    from trainer.metrics import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")
    steps, previous = [], 0.0
    for row in rows:
        wall = row["elapsed_s"] - previous
        previous = row["elapsed_s"]
        steps.append(
            {
                "step": row["step"],
                "wall_s": wall,
                "rollout_wait_s": row["seconds_rollout_wait"],
                "train_s": row["seconds_train"],
                "weight_sync_s": row["seconds_weight_sync"],
                "tokens_trained": row.get("tokens_computed", row["tokens"]),
                "trace_tokens": row["tokens"],
                "sessions": row.get("trajectories", 0),
            }
        )
    wall = rows[-1]["elapsed_s"] if rows else float("nan")
    # The steps ran in the `wall` seconds before the last step's progress line (after it the run
    # stops its services, which on a GPU can take as long as the steps did).
    steps_ended = last_step or ended
    first_step = steps_ended - wall if rows else started
    sampled, failed, error = _sessions(run_dir)
    if failed:
        raise SystemExit(f"bench_loop: {mode}: {failed} sessions failed; the first: {error}")
    busy = {gpu: samples.busy(gpu, first_step, steps_ended) for gpu in gpus}
    return ModeResult(
        mode=mode,
        wall_s=wall,
        startup_s=(serving or ended) - started,
        steps=steps,
        tokens_generated=sampled,
        tokens_trained=sum(step["tokens_trained"] for step in steps),
        gpu_busy_fraction=sum(busy.values()) / len(busy) if busy else float("nan"),
        # Each side's from its processes on its own GPU (the server also maps the trainer's weight-push
        # buffers on the trainer's: its memory there counts, its copies out of them do not).
        inference_busy_fraction=samples.busy(home["inference"], first_step, steps_ended, "inference"),
        trainer_busy_fraction=samples.busy(home["trainer"], first_step, steps_ended, "trainer"),
        inference_memory_gib=samples.memory_gib("inference"),
        trainer_memory_gib=samples.memory_gib("trainer"),
        gpus={
            f"cuda:{gpu}": {
                "busy_fraction": busy[gpu],
                "inference_memory_gib": samples.memory_gib("inference", gpu),
                "trainer_memory_gib": samples.memory_gib("trainer", gpu),
            }
            for gpu in gpus
        },
    )


def _sessions(run_dir: Path) -> tuple[int, int, str]:
    """The run's released sessions (its rollout store): tokens the engine sampled for them, how many
    failed, and the first failure's error."""
    from polar import codec
    from polar.rollout.store import RolloutStore
    from polar.v1 import common_pb2

    store = RolloutStore(run_dir / "rollout.db")
    try:
        groups = store.released_groups(0, max_groups=10_000, max_bytes=1 << 40)
    finally:
        store.close()
    sampled = failed = 0
    error = ""
    for group in groups:
        for blob in group.trajectories:
            trajectory = common_pb2.Trajectory.FromString(codec.decompress(blob, max_bytes=1 << 32))
            sampled += sum(len(call.sampled_token_ids) for call in trajectory.calls)
            if trajectory.outcome != common_pb2.SESSION_OUTCOME_COMPLETED:
                failed += 1
                error = error or f"{trajectory.error}: {trajectory.harness_output[-1500:]}"
    return sampled, failed, error


# ------------------------------------------------------------------------------------------ the model


def model_folder(shape: str, out: Path) -> Path:
    """A model of `shape` with random weights (bf16, built on the GPU), SmolLM2's tokenizer and vocabulary."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from polar.inference.models import resolve_model

    tokenizer = resolve_model("tiny")
    config = AutoConfig.for_model(
        **SHAPES[shape], vocab_size=json.loads((tokenizer / "config.json").read_text())["vocab_size"]
    )
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    for name in benchmark_common.TOKENIZER_FILES:
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, out / name)
    del model
    torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------------------------------ main


def main() -> int:
    args = _parse_args()
    if args.replay:
        return replay(args.replay)
    if args.score:
        return score()
    cuda = args.device.startswith("cuda")
    machine = benchmark_common.machine("torch", "transformers", device=args.device)
    machine["devices"] = {"inference": args.device, "trainer": args.trainer_device}
    # Under the repository, not the system's temporary folder: a node's isolated harness has a /tmp of its own.
    benchmark_common.RESULTS.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="loop-", dir=benchmark_common.RESULTS) as scratch:
        work = Path(scratch)
        shapes = []
        for harness in args.harnesses:
            path = work / f"{harness}.shape.json"
            path.write_text(json.dumps(session_shape(harness, args.turns)))
            shapes.append(path)
        model = str(model_folder(args.shape, work / args.shape)) if cuda else "tiny"
        results = []
        for mode in args.modes:
            print(f"bench_loop: {mode}: polar train, {args.steps} steps", flush=True)
            results.append(run_mode(mode, model, shapes, work, args))
            # After every mode, so that a run cut short still leaves the modes it finished.
            _write_report(results, machine, args)
    _print_table(results, machine, layout(args))
    return 0


def gpu_index(device: str) -> int | None:
    """The GPU of a device named as _device names it ("cuda:N"); None for the CPU."""
    return None if device == "cpu" else int(device.split(":")[1])


def layout(args: argparse.Namespace) -> str:
    """Where the two services ran, in words."""
    if args.device == "cpu":
        return "cpu"
    if args.device == args.trainer_device:
        return "one GPU, both services"
    return f"two GPUs: inference on {args.device}, trainer on {args.trainer_device}"


def _write_report(results: list[ModeResult], machine: dict, args: argparse.Namespace) -> None:
    cuda = args.device.startswith("cuda")
    modes = {r.mode: r.report() for r in results}
    base = modes.get("prefix_merging", {}).get("wall_s")
    ratios = {mode: entry["wall_s"] / base if base else float("nan") for mode, entry in modes.items()}
    keys = ("quick", "device", "trainer_device", "steps", "groups_per_step", "group_size", "max_batch_size")
    settings = {key: getattr(args, key) for key in keys} | {
        "harnesses": args.harnesses,
        "turns": args.turns,
        "model": args.shape if cuda else "tiny",
        "layout": layout(args),
    }
    report = {"machine": machine, "settings": settings, "modes": modes, "ratios_to_prefix_merging": ratios}
    benchmark_common.write_json(report, args.out, "loop.json")


def _print_table(results: list[ModeResult], machine: dict, layout: str) -> None:
    print(
        f"\nmachine: {machine['cpu']} ({machine['cpu_cores']} cores){', ' + machine['gpu'] if machine['gpu'] else ''}"
    )
    print(f"layout: {layout}")
    # With two GPUs, "GPU busy" is their mean; each one's follows.
    gpus = list(results[0].gpus) if results and len(results[0].gpus) > 1 else []
    header = (
        "mode",
        "wall s",
        "rollout wait",
        "train",
        "sync",
        "gen tok/s",
        "train tok/s",
        "GPU busy",
        *(f"{gpu} busy" for gpu in gpus),
        "infer",
        "trainer",
    )
    rows = []
    for r in results:
        entry = r.report()
        rows.append(
            (
                r.mode,
                f"{r.wall_s:.1f}",
                f"{entry['rollout_wait_s']:.1f}",
                f"{entry['train_s']:.1f}",
                f"{entry['weight_sync_s']:.2f}",
                f"{entry['generated_tokens_per_s']:,.0f}",
                f"{entry['trained_tokens_per_s']:,.0f}",
                _percent(r.gpu_busy_fraction),
                *(_percent(r.gpus[gpu]["busy_fraction"]) for gpu in gpus),
                _percent(r.inference_busy_fraction),
                _percent(r.trainer_busy_fraction),
            )
        )
    benchmark_common.print_table(header, rows)


def _percent(value: float) -> str:
    return "-" if value != value else f"{value:.1%}"


def _parse_args() -> argparse.Namespace:
    parser = benchmark_common.parser(__doc__, "tiny steps: 2 steps of 1 group of 4 Pi sessions per mode", "loop.json")
    parser.add_argument(
        "--device", type=_device, default="cpu", help="cpu, cuda or cuda:N: the inference server's (default: cpu)"
    )
    parser.add_argument(
        "--trainer-device",
        type=_device,
        help="the trainer's device (default: --device's); another GPU than --device's puts each service on a GPU of its own",
    )
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES), help="on cuda, the model's shape")
    parser.add_argument("--harnesses", nargs="+", choices=("claude-code", "pi"), help="whose recorded sessions")
    parser.add_argument(
        "--turns",
        choices=("recorded", "coding"),
        default="recorded",
        help=f"the calls after each session's first: the recording's, or {CODING_CALLS} of a coding session's (default: %(default)s)",
    )
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES), help="modes run, in order")
    parser.add_argument("--steps", type=int, help="trainer steps per mode (default: 3, --quick 2)")
    parser.add_argument("--groups-per-step", type=int, help="GRPO groups per step (default: 2, --quick 1)")
    parser.add_argument("--group-size", type=int, help="sessions per group (default: 8, --quick 4)")
    parser.add_argument("--max-batch-size", type=int, default=16, help="the engine's slots (default: %(default)s)")
    parser.add_argument("--verbose", action="store_true", help="echo polar train's output")
    parser.add_argument("--replay", metavar="SHAPE", help=argparse.SUPPRESS)
    parser.add_argument("--score", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.trainer_device = args.trainer_device or args.device
    if (args.device == "cpu") != (args.trainer_device == "cpu"):
        parser.error("--device and --trainer-device: both cpu, or both CUDA devices")
    args.harnesses = args.harnesses or (["pi"] if args.quick else ["claude-code", "pi"])
    args.steps = args.steps or (2 if args.quick else 3)
    args.groups_per_step = args.groups_per_step or (1 if args.quick else 2)
    args.group_size = args.group_size or (4 if args.quick else 8)
    return args


def _device(text: str) -> str:
    """A device argument, checked: "cpu", or "cuda:N" ("cuda" is cuda:0, the device a process starts on)."""
    match = re.fullmatch(r"cpu|cuda(?::(\d+))?", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not cpu, cuda or cuda:N")
    return text if text == "cpu" else f"cuda:{match.group(1) or 0}"


if __name__ == "__main__":
    sys.exit(main())
