"""The `polar` command line: one row of `COMMANDS` per job, each a thin call into the package.

    polar serve inference   an InferenceService server over one engine (torch, vllm, scripted)
    polar serve envoy       Envoy in front of the gateway and the inference servers (polar.envoy)
    polar serve gateway     the API dialects (HTTP) and GatewayService (gRPC) over an inference service
    polar serve rollout     the RolloutService: tasks in, sessions out to nodes, GRPO groups released
    polar serve node        a gateway plus the pools that run sessions for a rollout server
    polar session open|show|close   recording sessions on a gateway (keys, call records)
    polar tasks import swe  SWE-style dataset instances (SWE-bench, SWE-Gym, R2E-Gym) as a task file
    polar tasks import harbor   Harbor task directories as a task file, their images built
    polar tasks oracle      each SWE-style task's gold patch (Harbor task's solution) must score 1 and no change 0
    polar submit            tasks from a JSON Lines file, all or none
    polar status            the tasks' sessions per state, rewards, released groups (--watch: live)
    polar results           released groups exported as JSON Lines, resumable from a cursor
    polar up                the whole stack, on the embedded defaults or a TOML config (--submit: and a task file)
    polar credentials issue|revoke|list   credentials of other machines (nodes, inference servers), by name
    polar train             the stack plus the GRPO trainer on a config's dataset; resumes a run folder
    polar eval              greedy pass@1 and sampled pass@k on the held-out tasks, base or checkpoint
    polar merge             a LoRA checkpoint merged into its base model, written as a model folder
    polar generate          rejection sampling: N attempts per task, the accepted ones exported for SFT
    polar export            released groups as SFT rows (messages + tools, input_ids + loss_mask)
    polar view              a read-only web app over a run: steps, groups, sessions, calls, tokens
    polar version           the installed version

`polar serve NAME` is a row of polar.service_table: its flags are its config's fields (polar/config.py).
A failure is one line on stderr (`polar: error: ...`) and a non-zero exit, never a traceback:
usage mistakes exit 2, everything else 1, an interrupt 130.
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

import polar
from polar.config import STACK_ROLES, GatewayConfig, RolloutConfig, load_config
from polar.service_base import ServiceError, join_host_port
from polar.service_table import SERVICES


class CliError(Exception):
    """A failure the command line explains itself."""


def _user_errors() -> tuple[type[BaseException], ...]:
    """Failures of the user's input or environment; their messages are written for the user as they
    are. Anything else is a bug, still reported in one line but with its exception type."""
    from polar.rollout.client import RolloutError

    return (CliError, RolloutError, LookupError, ValueError, OSError, ServiceError)


@dataclass(frozen=True)
class Command:
    """A subcommand: its words after `polar`, its arguments and what it runs."""

    words: tuple[str, ...]  # e.g. ("serve", "inference"); the leading words group commands
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse's default prints the whole usage block first; one line points to --help instead.
        self.exit(2, f"polar: error: {message} (see: {self.prog} --help)\n")


# -------------------------------------------------------------------------------------- session


def _gateway_option(parser: argparse.ArgumentParser) -> None:
    default = join_host_port(GatewayConfig().host, GatewayConfig().grpc_port)
    parser.add_argument(
        "--gateway", default=default, metavar="HOST:PORT", help="GatewayService address (default: %(default)s)"
    )


def _session_open_arguments(parser: argparse.ArgumentParser) -> None:
    _gateway_option(parser)
    parser.add_argument("--task-id", default="", help="task the session runs, for bookkeeping")
    parser.add_argument("--history", choices=("faithful", "template"), help="history policy (default: the gateway's)")


def _session_key_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("key", help="the session's key or id")
    _gateway_option(parser)


def _session_show_arguments(parser: argparse.ArgumentParser) -> None:
    _session_key_arguments(parser)
    parser.add_argument("--json", action="store_true", help="the session and every call record as JSON")


# A session is read one call record per message (WatchSession), never whole (GetSession), so that its
# size is not bounded by a message limit; one record holds a harness request as Envoy let it through
# ([envoy] max_request_bytes, 32 MiB by default), its response and their token ids.
SESSION_RECORD_BYTES = 256 * 1024 * 1024
SESSION_READ_TIMEOUT_S = 300.0


def _gateway_rpc(address: str, method: str, request, *, stream: bool = False):
    """One GatewayService call (with `stream`, a server-streaming one read to its end: the list of
    its messages); gRPC failures become one-line errors."""
    import grpc

    from polar import credentials
    from polar.v1 import gateway_pb2_grpc

    options = [("grpc.max_receive_message_length", SESSION_RECORD_BYTES)] if stream else []
    with credentials.channel(address, credentials.OPERATOR, credentials.for_commands(), options) as channel:
        call = getattr(gateway_pb2_grpc.GatewayServiceStub(channel), method)
        try:
            if stream:
                return list(call(request, timeout=SESSION_READ_TIMEOUT_S))
            return call(request, timeout=10)
        except grpc.RpcError as exc:
            raise CliError(f"{method} on {address}: {exc.code().name}: {exc.details()}") from None


def _session_open(args: argparse.Namespace) -> int:
    from polar.v1 import gateway_pb2

    history = {
        None: 0,
        "faithful": gateway_pb2.HISTORY_POLICY_FAITHFUL,
        "template": gateway_pb2.HISTORY_POLICY_TEMPLATE,
    }
    request = gateway_pb2.OpenSessionRequest(task_id=args.task_id, history=history[args.history])
    print(_gateway_rpc(args.gateway, "OpenSession", request).session.key)
    return 0


def _session_show(args: argparse.Namespace) -> int:
    from google.protobuf import json_format

    from polar.v1 import common_pb2, gateway_pb2

    session = _gateway_rpc(
        args.gateway, "GetSession", gateway_pb2.GetSessionRequest(key=args.key, omit_calls=True)
    ).session
    request = gateway_pb2.WatchSessionRequest(key=args.key, until_caught_up=True)
    calls = [message.call for message in _gateway_rpc(args.gateway, "WatchSession", request, stream=True)]
    session.call_count = len(calls)  # calls completed between the two reads are listed too
    response = gateway_pb2.GetSessionResponse(session=session, calls=calls)
    if args.json:
        print(json_format.MessageToJson(response, indent=2))
        return 0
    s = response.session
    print(f"session {s.session_id} ({'closed' if s.closed else 'open'}), {s.call_count} calls")
    for call in response.calls:
        finish = common_pb2.FinishReason.Name(call.finish_reason).removeprefix("FINISH_REASON_").lower()
        extends = f" extends {call.extends_call_id}" if call.extends_call_id else ""
        print(
            f"  {call.call_id}  {common_pb2.Dialect.Name(call.dialect).removeprefix('DIALECT_').lower()}  "
            f"prompt {len(call.prompt_token_ids)}  sampled {len(call.sampled_token_ids)}  {finish}"
            f"{'  aborted' if call.aborted else ''}{extends}"
        )
    return 0


def _session_close(args: argparse.Namespace) -> int:
    from polar.v1 import gateway_pb2

    session = _gateway_rpc(args.gateway, "CloseSession", gateway_pb2.CloseSessionRequest(key=args.key)).session
    print(f"closed session {session.session_id} ({session.call_count} calls)")
    return 0


# ------------------------------------------------------------------------------ submit, status, results


def _rollout_option(parser: argparse.ArgumentParser) -> None:
    default = join_host_port(RolloutConfig().host, RolloutConfig().port)
    parser.add_argument(
        "--rollout", default=default, metavar="HOST:PORT", help="RolloutService address (default: %(default)s)"
    )


def _submit_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "file", metavar="TASKS.jsonl", help="one Task per line (protobuf JSON; '#' lines skipped); - reads stdin"
    )
    _rollout_option(parser)


def _submit(args: argparse.Namespace) -> int:
    from polar.rollout.client import RolloutClient, read_tasks

    tasks = read_tasks(args.file)
    with RolloutClient(args.rollout) as rollout:
        for task_id in rollout.submit(tasks):
            print(task_id)
    return 0


def _status_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("task_ids", nargs="*", metavar="TASK_ID", help="tasks to show (default: every task)")
    _rollout_option(parser)
    parser.add_argument("--watch", action="store_true", help="redraw until every task is released (or Ctrl-C)")
    parser.add_argument(
        "--interval",
        type=_positive_float,
        default=1.0,
        metavar="SECONDS",
        help="--watch: seconds between redraws (default: %(default)s)",
    )


def _status(args: argparse.Namespace) -> int:
    from polar.rollout.watch import show_status

    show_status(args.rollout, args.task_ids, watch=args.watch, interval_s=args.interval)
    return 0


def _results_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--export",
        required=True,
        metavar="OUT.jsonl",
        help="file to write, one Trajectory per line (protobuf JSON), whole groups in release order; - for stdout",
    )
    _rollout_option(parser)
    parser.add_argument("--cursor", default="", help="start after this cursor (printed by an earlier export)")
    parser.add_argument(
        "--follow", action="store_true", help="keep exporting groups as they are released, until Ctrl-C or SIGTERM"
    )


def _results(args: argparse.Namespace) -> int:
    from polar.rollout.client import export_results

    return export_results(args.rollout, args.export, args.cursor, args.follow)


# ---------------------------------------------------------------------------------------- tasks


def _tasks_import_arguments(parser: argparse.ArgumentParser) -> None:
    from polar.app.swe.instances import FLAVORS

    parser.add_argument(
        "source",
        choices=("swe", "harbor"),
        help="what the paths hold: swe (a file of SWE-style repository instances) or harbor (task directories)",
    )
    parser.add_argument(
        "file",
        metavar="PATH",
        nargs="+",
        help="swe: one file of instances (JSON Lines, a JSON array, or Parquet); harbor: task directories"
        " or folders of them",
    )
    parser.add_argument("--flavor", choices=FLAVORS, help="swe (required): the dataset's field names and image rule")
    parser.add_argument(
        "--local",
        metavar="DIR",
        help="no Docker: DIR/<owner>/<name> is a git checkout of each instance's repo, used at its base commit",
    )
    parser.add_argument(
        "--image-template",
        default="",
        help="Docker image name with {instance_id} or {repo_name} (default: the flavor's rule)",
    )
    parser.add_argument("--preset", default="pi", help="harness preset of every task (default: %(default)s)")
    parser.add_argument(
        "--group-size", type=int, default=1, help="sessions per task, one GRPO group (default: %(default)s)"
    )
    parser.add_argument(
        "--timeout",
        type=_positive_float,
        default=1800.0,
        help="seconds the harness may run (default: %(default)s; harbor: where task.toml's [agent] gives none)",
    )
    parser.add_argument(
        "--test-timeout",
        type=_positive_float,
        default=600.0,
        help="seconds the tests may run when grading (default: %(default)s; harbor: where [verifier] gives none)",
    )
    parser.add_argument(
        "--test-command", default="", help="test command with {files} (default: the instance's, else pytest -rA)"
    )
    parser.add_argument("--hints", action="store_true", help="add the instance's hints to the instruction")
    parser.add_argument(
        "--sampling", default="", metavar="JSON", help="every task's sampling, e.g. '{\"maxTokensPerCall\": 512}'"
    )
    parser.add_argument("--out", default="-", metavar="TASKS.jsonl", help="where to write the tasks (default: stdout)")


def _tasks_import(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from google.protobuf import json_format

    try:
        sampling = json.loads(args.sampling) if args.sampling else {}
    except json.JSONDecodeError as exc:
        raise CliError(f"--sampling is not JSON: {exc}") from None
    if not 1 <= args.group_size <= 4096:
        raise CliError(f"--group-size must be between 1 and 4096, not {args.group_size}")
    if args.source == "harbor":
        tasks = _harbor_tasks(args, sampling)
    else:
        tasks = _swe_tasks(args, sampling)
    lines = "".join(json.dumps(json_format.MessageToDict(task), ensure_ascii=False) + "\n" for task in tasks)
    if args.out == "-":
        sys.stdout.write(lines)
    else:
        Path(args.out).write_text(lines, encoding="utf-8")
        print(f"polar tasks import: {len(tasks)} tasks written to {args.out}", file=sys.stderr)
    return 0


def _harbor_tasks(args: argparse.Namespace, sampling: dict) -> list:
    from pathlib import Path

    from google.protobuf import json_format

    from polar.app.harbor.tasks import HarborTaskError, ImportOptions, import_tasks

    given = {
        "--flavor": args.flavor,
        "--local": args.local,
        "--image-template": args.image_template,
        "--test-command": args.test_command,
        "--hints": args.hints,
    }
    swe_only = [flag for flag, value in given.items() if value]
    if swe_only:
        raise CliError(f"{', '.join(swe_only)}: only for `polar tasks import swe`")
    options = ImportOptions(
        preset=args.preset,
        group_size=args.group_size,
        timeout_s=args.timeout,
        verifier_timeout_s=args.test_timeout,
        sampling=sampling,
    )
    try:
        return import_tasks([Path(path) for path in args.file], options)
    except HarborTaskError as exc:
        raise CliError(str(exc)) from None
    except json_format.ParseError as exc:
        raise CliError(f"--sampling: {exc}") from None


def _swe_tasks(args: argparse.Namespace, sampling: dict) -> list:
    from pathlib import Path

    from google.protobuf import json_format

    from polar.app.swe.instances import ImportOptions, import_tasks

    if args.flavor is None:
        raise CliError("--flavor is required for `polar tasks import swe`")
    if len(args.file) != 1:
        raise CliError(f"`polar tasks import swe` reads one file, not {len(args.file)}")
    options = ImportOptions(
        flavor=args.flavor,
        local=Path(args.local) if args.local else None,
        image_template=args.image_template,
        preset=args.preset,
        group_size=args.group_size,
        timeout_s=args.timeout,
        evaluator_timeout_s=args.test_timeout,
        hints=args.hints,
        test_command=args.test_command,
        sampling=sampling,
    )
    if options.local is not None and not options.local.is_dir():
        raise CliError(f"--local {args.local}: no such folder")
    try:
        return import_tasks(Path(args.file[0]), options)
    except json_format.ParseError as exc:
        raise CliError(f"--sampling: {exc}") from None


def _tasks_oracle_arguments(parser: argparse.ArgumentParser) -> None:
    from polar.app.swe.oracle import default_jobs

    parser.add_argument("file", metavar="TASKS.jsonl", help="a task file (made by `polar tasks import swe|harbor`)")
    parser.add_argument("--jobs", type=int, default=default_jobs(), help="tasks checked at once (default: %(default)s)")


def _tasks_oracle(args: argparse.Namespace) -> int:
    from polar.app.swe.oracle import oracle_command
    from polar.rollout.client import read_tasks

    if args.jobs < 1:
        raise CliError(f"--jobs must be at least 1, not {args.jobs}")
    return oracle_command(read_tasks(args.file), args.jobs)


# ------------------------------------------------------------------------------------------- up


def _up_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML file overriding the embedded defaults (see polar/config.py)")
    parser.add_argument(
        "--submit",
        metavar="TASKS.jsonl",
        help="once the stack serves, submit these tasks and print their progress until every group is released",
    )
    parser.add_argument(
        "--role",
        choices=STACK_ROLES,
        default="all",
        help="this machine's share of a stack on several: all (the whole stack), inference (an inference server"
        " joining --rollout's control plane), node (Envoy and a gateway node working for --rollout)",
    )
    parser.add_argument("--rollout", default="", metavar="HOST:PORT", help="the rollout server to join (with --role)")


def _up(args: argparse.Namespace) -> int:
    from polar.app.stack import run_stack
    from polar.rollout.client import read_tasks
    from polar.rollout.watch import submit_and_follow

    # The file is checked before anything starts: a bad line should not cost a stack start-up.
    if args.role != "all" and not args.rollout:
        raise CliError(f"--role {args.role} joins a rollout server on another machine: give --rollout HOST:PORT")
    if args.role == "all" and args.rollout:
        raise CliError("--rollout names the rollout server a machine of --role inference or node joins")
    if args.submit and args.role != "all":
        raise CliError(
            "--submit needs the whole stack (--role all); submit to a remote one with `polar submit --rollout`"
        )
    tasks = read_tasks(args.submit) if args.submit else None
    config = load_config(args.config)
    if tasks is None:
        return run_stack(config, role=args.role, rollout=args.rollout)

    def follow(addresses: dict[str, str]) -> None:
        threading.Thread(target=submit_and_follow, args=(addresses["rollout"], tasks), daemon=True).start()

    return run_stack(config, on_ready=follow)


# ---------------------------------------------------------------------------------- credentials


def _issued_file_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        help="the stack's TOML file, for [rollout] issued_credentials (default: issued.json in the"
        " stack's credentials folder, $POLAR_CREDENTIALS or the state folder's)",
    )


def _issued_file(args: argparse.Namespace):
    import os

    from polar import credentials

    configured = load_config(args.config).rollout.issued_credentials if args.config else ""
    return credentials.issued_path(os.environ.get(credentials.ENV_VAR) or None, configured)


def _credentials_issue_arguments(parser: argparse.ArgumentParser) -> None:
    from polar.credentials import ISSUED_ROLES

    parser.add_argument("name", help="the machine's name (letters, digits, '.', '_', '-'); it joins only as this name")
    parser.add_argument(
        "role", choices=ISSUED_ROLES, help="node (Envoy and a gateway node) or inference (an inference server)"
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        help="write the token to DIR/ROLE (mode 0600): the credentials folder to copy to that"
        " machine's state folder; without it the token is printed",
    )
    _issued_file_option(parser)


def _credentials_issue(args: argparse.Namespace) -> int:
    from polar import credentials

    token = credentials.issue(_issued_file(args), args.name, args.role)
    if args.out:
        written = credentials.write_token(args.out, args.role, token)
        print(f"credential {args.name} ({args.role}) issued: {written}")
    else:
        print(token)
    return 0


def _credentials_revoke_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="the credential's name")
    _issued_file_option(parser)


def _credentials_revoke(args: argparse.Namespace) -> int:
    from polar import credentials

    credentials.revoke(_issued_file(args), args.name)
    print(f"credential {args.name} revoked: its calls are refused, its node and upstreams removed within a second")
    return 0


def _credentials_list(args: argparse.Namespace) -> int:
    import time

    from polar import credentials

    entries = credentials.read_issued(_issued_file(args))
    if not entries:
        print("no credentials issued")
        return 0
    width = max(len(entry.name) for entry in entries)
    print(f"{'NAME':<{width}}  ROLE       ISSUED (UTC)")
    for entry in sorted(entries, key=lambda e: e.name):
        issued = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(entry.issued_at))
        print(f"{entry.name:<{width}}  {entry.role:<9}  {issued}")
    return 0


# ---------------------------------------------------------------------------------- train, eval


def _train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="TOML file: [trainer] and any stack section (see polar/config.py)")
    parser.add_argument("--run-dir", help="the run's folder; run again with it to resume (default: [trainer] run_dir)")
    parser.add_argument(
        "--backend", choices=("torch", "megatron"), help="the trainer backend (default: [trainer] backend)"
    )
    parser.add_argument(
        "--gpus", type=int, help="trainer processes, one per GPU; > 1 needs megatron (default: [trainer] gpus)"
    )
    parser.add_argument(
        "--join",
        default="",
        metavar="HOST:PORT",
        help="train a LoRA adapter on the running stack whose rollout server is at HOST:PORT (`polar up`"
        " with [inference] lora_rank and max_adapters), beside other runs, instead of starting a stack",
    )


def _train(args: argparse.Namespace) -> int:
    import dataclasses
    from pathlib import Path

    from polar.app.train import train

    config = load_config(args.config)
    if args.gpus is not None and args.gpus < 1:
        raise CliError(f"--gpus must be at least 1, not {args.gpus}")
    chosen = {name: value for name, value in (("backend", args.backend), ("gpus", args.gpus)) if value is not None}
    if chosen:
        config = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, **chosen))
    return train(config, Path(args.run_dir or config.trainer.run_dir), join=args.join)


def _eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="TOML file: [trainer] heldout, eval_samples, pass_threshold, ...")
    parser.add_argument("--checkpoint", help="a checkpoint folder (RUN_DIR/checkpoints/step-N) or a model folder")
    parser.add_argument("--out", default="eval.json", help="the report as JSON (default: %(default)s)")
    parser.add_argument(
        "--run-dir",
        help="a run folder: evaluate its base model and latest checkpoint into DIR/eval/ and draw DIR/eval.png",
    )


def _eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from polar.app.train import evaluate, evaluate_run

    config = load_config(args.config)
    if args.run_dir:
        if args.checkpoint:
            raise CliError("--run-dir evaluates the run's own base model and latest checkpoint: leave out --checkpoint")
        return evaluate_run(config, Path(args.run_dir))
    return evaluate(config, Path(args.checkpoint) if args.checkpoint else None, Path(args.out))


def _merge_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("adapter", help="a LoRA checkpoint (RUN_DIR/checkpoints/step-N) or a PEFT adapter folder")
    parser.add_argument("out", help="the folder to write the merged model to (must not exist yet)")
    parser.add_argument("--model", help="the base model (default: the one the adapter's config names)")


def _merge(args: argparse.Namespace) -> int:
    from pathlib import Path

    from polar.app.train import merge_checkpoint

    out = Path(args.out)
    if out.exists():
        raise CliError(f"{out} exists already: name a new folder")
    base = merge_checkpoint(Path(args.adapter), out, args.model or "")
    print(f"polar merge: {out} holds {base} with the adapter merged into its weights")
    return 0


# ------------------------------------------------------------------------------ generate, export


def _format_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--format",
        choices=("jsonl", "parquet", "datasets"),
        default="jsonl",
        help="jsonl (default); parquet or datasets (a Hugging Face datasets folder) need the 'export' extra",
    )


def _generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("tasks", metavar="TASKS.jsonl", help="the task file (the `polar submit` format)")
    parser.add_argument("--config", help="TOML file of the stack to start (see polar/config.py); not with --rollout")
    parser.add_argument(
        "--rollout", default="", metavar="HOST:PORT", help="a running stack's rollout server instead of starting one"
    )
    parser.add_argument("--attempts", type=int, required=True, metavar="N", help="attempts per task")
    parser.add_argument("--accept", type=float, required=True, metavar="R", help="least reward of an accepted attempt")
    parser.add_argument(
        "--max-per-task", type=int, default=0, metavar="K", help="most accepted attempts per task (default: no cap)"
    )
    parser.add_argument(
        "--out", required=True, metavar="DIR", help="attempts.jsonl, accepted.jsonl, manifest.json; run again to resume"
    )
    parser.add_argument("--seed", type=int, default=0, help="the order attempts run in (default: %(default)s)")
    parser.add_argument(
        "--concurrency", type=int, default=0, help="attempts running at once (default: [node] running_slots)"
    )
    _format_option(parser)


def _generate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from polar.app.generate.run import GenerateOptions, generate

    if args.config and args.rollout:
        raise CliError("--config describes a stack to start and --rollout names a running one: give one of them")
    if args.concurrency < 0:
        raise CliError(f"--concurrency must be >= 0, not {args.concurrency}")
    options = GenerateOptions(
        tasks_file=args.tasks,
        out=Path(args.out),
        attempts=args.attempts,
        accept=args.accept,
        max_per_task=args.max_per_task,
        seed=args.seed,
        concurrency=args.concurrency,
        fmt=args.format,
        rollout=args.rollout,
        config_path=args.config or "",
    )
    return generate(load_config(args.config), options)


def _export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", required=True, metavar="FILE", help="the rows (JSON Lines, Parquet, or a datasets folder)"
    )
    _rollout_option(parser)
    parser.add_argument(
        "--min-reward", type=float, default=float("-inf"), help="least reward of an exported trajectory (default: any)"
    )
    parser.add_argument("--cursor", default="", help="start after this cursor (printed by an earlier export)")
    _format_option(parser)


def _export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from polar.app.generate.run import export_released

    read, written, cursor = export_released(
        args.rollout, Path(args.out), min_reward=args.min_reward, fmt=args.format, cursor=args.cursor
    )
    print(f"exported {written} rows of {read} trajectories to {args.out}")
    print(f"cursor: {cursor}" if cursor else "cursor: none (nothing released yet)")
    return 0


# --------------------------------------------------------------------------------------- verify


def _verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "files",
        nargs="+",
        metavar="FILE",
        help="session files: a Trajectory with its calls and traces (.json, .pb, optionally .zst)",
    )
    parser.add_argument(
        "--model",
        default="",
        help="the served model (tiny, smollm2-135m or a folder), whose tokenizer replays the "
        "grammar of constrained calls (forced tool calls, JSON schemas) to check that it admitted every sampled token",
    )


def _verify(args: argparse.Namespace) -> int:
    from polar.inference.constraints import TokenGrammar
    from polar.trajectory.verify import verify_command

    grammar = TokenGrammar.for_model(args.model) if args.model else None
    # The worst outcome decides: 2 (a file could not be read) over 1 (a trace is unfaithful) over 0.
    return max(verify_command(path, sys.stdout, grammar) for path in args.files)


# ----------------------------------------------------------------------------------------- view


def _view_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rollout",
        default="",
        metavar="HOST:PORT",
        help="a running rollout server (`polar up`, `polar train`): its groups appear as they are released",
    )
    parser.add_argument(
        "--run-dir", help="a training run's folder: its metrics.jsonl, and the rollout store of a run that is over"
    )
    parser.add_argument("--port", type=int, default=8070, help="HTTP port; 0 picks a free one (default: %(default)s)")
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: %(default)s, this machine only: every session is readable by whoever reaches it)",
    )
    parser.add_argument("--config", help="the run's TOML file: [trainer] advantage settings and model")
    parser.add_argument(
        "--model",
        default="",
        help="the served model (tiny, smollm2-135m or a folder) whose tokenizer shows each token's "
        "text (default: the run's model, from --config or its latest checkpoint; else token ids)",
    )


def _view_model(args: argparse.Namespace, config) -> str:
    from pathlib import Path

    from trainer.checkpoints import CheckpointError, latest_checkpoint

    if args.model:
        return args.model
    if args.config:
        return config.trainer.model
    if args.run_dir:
        try:
            checkpoint = latest_checkpoint(Path(args.run_dir))
        except CheckpointError:
            checkpoint = None
        if checkpoint is not None and checkpoint.state.base_model:
            return checkpoint.state.base_model
    return ""


def _view(args: argparse.Namespace) -> int:
    from pathlib import Path

    from polar.app.view.server import ViewOptions, run_view

    if not 0 <= args.port <= 65535:
        raise CliError(f"--port must be in 0..65535, not {args.port}")
    config = load_config(args.config)
    model = _view_model(args, config)
    options = ViewOptions(
        run_dir=Path(args.run_dir) if args.run_dir else None,
        rollout=args.rollout,
        host=args.host,
        port=args.port,
        model=model,
        advantage_scale=config.trainer.advantage_scale,
        leave_one_out=config.trainer.leave_one_out,
        too_long=config.trainer.too_long,
        microbatch_tokens=_view_microbatch_tokens(config, model),
    )
    return run_view(options)


def _view_microbatch_tokens(config, model: str) -> int:
    """The trainer's micro-batch in tokens, past which a trace is not trained on: [trainer]
    max_tokens_per_microbatch, else (0) the model's context length, as the trainer takes it; 0 when
    neither is known."""
    import json

    from polar.inference.models import ModelNotFoundError, resolve_model

    if config.trainer.max_tokens_per_microbatch:
        return config.trainer.max_tokens_per_microbatch
    if not model:
        return 0
    try:
        folder = resolve_model(model)
        return int(json.loads((folder / "config.json").read_text()).get("max_position_embeddings", 0))
    except (ModelNotFoundError, OSError, ValueError):
        return 0


# -------------------------------------------------------------------------------------- version


def _version(args: argparse.Namespace) -> int:
    print(f"polar {polar.__version__}")
    return 0


COMMANDS: tuple[Command, ...] = (
    *(Command(("serve", s.name), s.help, s.add_arguments, s.run) for s in SERVICES),
    Command(
        ("session", "open"),
        "open a recording session on a gateway and print its key",
        _session_open_arguments,
        _session_open,
    ),
    Command(("session", "show"), "print a session and its call records", _session_show_arguments, _session_show),
    Command(
        ("session", "close"),
        "close a session (its key is refused from then on)",
        _session_key_arguments,
        _session_close,
    ),
    Command(
        ("tasks", "import"),
        "convert dataset instances or Harbor tasks into a task file",
        _tasks_import_arguments,
        _tasks_import,
    ),
    Command(
        ("tasks", "oracle"),
        "check SWE-style or Harbor tasks: gold patch or solution scores 1, no change 0",
        _tasks_oracle_arguments,
        _tasks_oracle,
    ),
    Command(
        ("submit",),
        "submit the tasks of a JSON Lines file (all or none) and print their ids",
        _submit_arguments,
        _submit,
    ),
    Command(
        ("status",),
        "show each task's sessions per state, its reward and whether it was released",
        _status_arguments,
        _status,
    ),
    Command(
        ("results",),
        "export released groups as JSON Lines and print the cursor to resume from",
        _results_arguments,
        _results,
    ),
    Command(("up",), "start the whole stack and supervise it until Ctrl-C", _up_arguments, _up),
    Command(
        ("credentials", "issue"),
        "issue another machine its own credential (node or inference)",
        _credentials_issue_arguments,
        _credentials_issue,
    ),
    Command(
        ("credentials", "revoke"),
        "revoke a machine's credential: it is cut off",
        _credentials_revoke_arguments,
        _credentials_revoke,
    ),
    Command(
        ("credentials", "list"), "list the credentials issued to other machines", _issued_file_option, _credentials_list
    ),
    Command(("train",), "train the served model with GRPO on a dataset, the stack included", _train_arguments, _train),
    Command(("eval",), "score a checkpoint (or the base model) on the held-out tasks", _eval_arguments, _eval),
    Command(
        ("merge",), "write a LoRA checkpoint merged into its base model as a model folder", _merge_arguments, _merge
    ),
    Command(
        ("generate",), "run N attempts per task and keep those that pass, as SFT data", _generate_arguments, _generate
    ),
    Command(
        ("export",),
        "export released trajectories as SFT rows (messages, tools, token ids, loss mask)",
        _export_arguments,
        _export,
    ),
    Command(
        ("verify",),
        "check that every trainable token of a session's traces is what the engine sampled",
        _verify_arguments,
        _verify,
    ),
    Command(
        ("view",),
        "serve a read-only web app over a run: plots, groups, sessions, calls, tokens",
        _view_arguments,
        _view,
    ),
    Command(("version",), "print the installed version", lambda parser: None, _version),
)

GROUP_HELP = {
    "serve": "run one service in the foreground",
    "session": "open, show and close gateway sessions",
    "tasks": "import dataset instances as tasks and check them",
    "credentials": "issue, revoke and list other machines' credentials",
}


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every command. Given the arguments it is to parse, only their command gets its
    own arguments (the others keep their names and help): some commands' arguments import what
    they offer (dataset flavours, an oracle's default jobs), which every other command, each service
    of the stack among them, would pay for at start."""
    root = _Parser(prog="polar", description="Reinforcement learning for unmodified language agents.")
    subparsers = {(): root.add_subparsers(dest="command", metavar="COMMAND", required=True)}
    for command in COMMANDS:
        for depth in range(1, len(command.words)):
            group = command.words[:depth]
            if group not in subparsers:
                group_parser = subparsers[group[:-1]].add_parser(group[-1], help=GROUP_HELP[group[-1]])
                subparsers[group] = group_parser.add_subparsers(dest="_".join(group), metavar="SERVICE", required=True)
        parser = subparsers[command.words[:-1]].add_parser(command.words[-1], help=command.help)
        if argv is None or tuple(argv[: len(command.words)]) == command.words:
            command.add_arguments(parser)
        parser.set_defaults(run=command.run)
    return root


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except _user_errors() as exc:
        return _fail(str(exc))
    except Exception as exc:
        return _fail(f"internal error: {type(exc).__name__}: {exc}")


def _fail(message: str) -> int:
    # Multi-line messages (parser errors quoting input) are folded so the error stays one line.
    print("polar: error: " + " ".join(message.split()), file=sys.stderr)
    return 1


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number > 0")
    return value
