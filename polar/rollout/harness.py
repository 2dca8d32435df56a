"""Harness presets: how to start each agent CLI non-interactively against the gateway.

    launch = prepare_launch(task.harness, HarnessContext(...), search_path="node_modules/.bin")
    result = await runtime.run(launch.argv, env=launch.env, timeout_s=...)

A preset knows one CLI's quirks: its flags for a headless run with every permission prompt off, the
config files it needs in its HOME (written by `prepare_launch` into the session's private, empty HOME),
and its own shell tool (what a scripted model calls in tests). Every preset gets the same environment,
built from scratch: every dialect's base URL names the gateway and every API-key variable holds the
session key, so whichever SDK a harness uses, its calls land in this session's trajectory and nowhere
else. Nothing is inherited from the node's environment but PATH (no proxy variables: Qwen Code sends
even loopback requests through an env proxy, ignoring NO_PROXY). Telemetry, update checks and
onboarding are off, so a harness contacts only the gateway.

"command" runs `HarnessSpec.command` as given, with the same environment (the instruction is in
POLAR_INSTRUCTION).

A preset's CLI speaks the dialects in `Preset.dialects`, its default first; `HarnessSpec.dialect`
picks another where there is one: Pi speaks all four (its provider's `api` in models.json).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from polar.v1 import common_pb2, rollout_pb2


class HarnessError(Exception):
    """A harness cannot be launched: unknown preset, missing CLI (the message names its npm package),
    or an empty command."""


@dataclass(frozen=True)
class HarnessContext:
    """What a preset needs to know about one session."""

    instruction: str
    base_url: str  # the gateway as harnesses see it (Envoy's harness listener), e.g. http://127.0.0.1:8080, no /v1
    key: str  # the session key: every API-key variable holds it
    model: str  # the served model's name
    home: Path  # the harness's private, empty HOME; config files are written here
    workspace: Path  # the harness's cwd
    session_id: str
    task_id: str
    context_length: int = 0  # the served model's context window in tokens; 0: not known


@dataclass(frozen=True)
class Launch:
    """A ready-to-run harness process."""

    argv: list[str]  # argv[0] resolved to a path when found on the search path or PATH
    env: dict[str, str]  # the whole environment, built from scratch


@dataclass(frozen=True)
class ShellTool:
    """A CLI's own shell tool, as a model calls it: the tool's name and the argument holding the command."""

    name: str
    command_argument: str

    def call(self, command: str) -> dict:
        """A tool call (name + arguments) running `command`."""
        return {"name": self.name, "arguments": {self.command_argument: command}}


# What a preset builds: argv (argv[0] a bare program name) and the preset's own environment variables.
PresetLaunch = tuple[list[str], dict[str, str]]
LaunchBuilder = Callable[[rollout_pb2.HarnessSpec, HarnessContext], PresetLaunch]


@dataclass(frozen=True)
class Preset:
    """One harness CLI: where it comes from, its shell tool, and how to launch it."""

    name: str
    package: str  # the npm package that installs the CLI; "" for "command"
    shell_tool: ShellTool | None  # None for "command" (its tools are whatever the command has)
    build: LaunchBuilder
    # The API dialects (polar.v1.Dialect) the CLI can be told to speak, its default first; empty for
    # "command" (whatever the command speaks).
    dialects: tuple[int, ...] = ()

    def dialect(self, spec: rollout_pb2.HarnessSpec) -> int:
        """The dialect a session of `spec` speaks: the one it names, else the preset's default."""
        return spec.dialect or (self.dialects[0] if self.dialects else common_pb2.DIALECT_UNSPECIFIED)


# ---------------------------------------------------------------------------------------------------
# The environment every harness gets
# ---------------------------------------------------------------------------------------------------


def session_environment(ctx: HarnessContext, path: str) -> dict[str, str]:
    """Every dialect's base URL → the gateway, every key variable → the session key, and the session's
    identity, for any harness (SDKs and CLIs read different names for the same thing)."""
    openai_url = ctx.base_url + "/v1"
    return {
        "PATH": path,
        "HOME": str(ctx.home),
        "TERM": "dumb",
        "NO_COLOR": "1",
        "CI": "1",
        "LANG": "C.UTF-8",
        # OpenAI SDKs and the CLIs built on them (Qwen Code reads OPENAI_MODEL).
        "OPENAI_BASE_URL": openai_url,
        "OPENAI_API_BASE": openai_url,
        "OPENAI_API_KEY": ctx.key,
        "OPENAI_MODEL": ctx.model,
        # Anthropic SDKs append /v1/messages to the base URL themselves.
        "ANTHROPIC_BASE_URL": ctx.base_url,
        "ANTHROPIC_API_KEY": ctx.key,
        "ANTHROPIC_MODEL": ctx.model,
        # Google's genai SDKs and Gemini CLI append /v1beta/models/... themselves.
        "GOOGLE_GEMINI_BASE_URL": ctx.base_url,
        "GEMINI_API_KEY": ctx.key,
        "GOOGLE_API_KEY": ctx.key,
        "GEMINI_MODEL": ctx.model,
        "POLAR_BASE_URL": ctx.base_url,
        "POLAR_SESSION_KEY": ctx.key,
        "POLAR_MODEL": ctx.model,
        "POLAR_INSTRUCTION": ctx.instruction,
        "POLAR_SESSION_ID": ctx.session_id,
        "POLAR_TASK_ID": ctx.task_id,
        "POLAR_WORKSPACE": str(ctx.workspace),
    }


def _write_json(path: Path, value: Mapping) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2) + "\n")


def _toml_string(value: str) -> str:
    # A JSON string (ASCII, \" \\ \uXXXX escapes) is a valid TOML basic string.
    return json.dumps(value)


# ---------------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------------


def _codex(spec: rollout_pb2.HarnessSpec, ctx: HarnessContext) -> PresetLaunch:
    codex_home = ctx.home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)  # Codex refuses to start without it
    # Codex has metadata only for the models of its own catalog; for any other it assumes a 272k
    # context and would compact its history past the served model's window, so it is told that window.
    # It still warns that the model's metadata was not found: a catalog entry for the served model
    # (config.toml's model_catalog_json, or the provider's GET /models, which Codex reads only when
    # the provider authenticates by command or through ChatGPT) must carry the model's instructions,
    # which would replace Codex's own system prompt.
    context_window = f"model_context_window = {ctx.context_length}\n" if ctx.context_length > 0 else ""
    # Codex speaks only the Responses API (streaming); a custom provider points it at the gateway.
    (codex_home / "config.toml").write_text(
        f"model = {_toml_string(ctx.model)}\n"
        f"{context_window}"
        'model_provider = "polar"\n'
        "[model_providers.polar]\n"
        'name = "polar"\n'
        f"base_url = {_toml_string(ctx.base_url + '/v1')}\n"
        'env_key = "POLAR_SESSION_KEY"\n'
        'wire_api = "responses"\n'
        "[analytics]\nenabled = false\n"
        '[otel]\nexporter = "none"\n'
    )
    argv = [
        "codex",
        "exec",
        "--skip-git-repo-check",
        "--dangerously-bypass-approvals-and-sandbox",
        "--",
        ctx.instruction,
    ]
    return argv, {"CODEX_HOME": str(codex_home)}


def _claude_code(spec: rollout_pb2.HarnessSpec, ctx: HarnessContext) -> PresetLaunch:
    # Headless (-p) it needs no config file: no onboarding screens, and ANTHROPIC_API_KEY is used as is.
    env = {
        # Its background calls (titles, summaries, subagents) ask for these model aliases: all one model.
        "ANTHROPIC_SMALL_FAST_MODEL": ctx.model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": ctx.model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": ctx.model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": ctx.model,
        "CLAUDE_CODE_SUBAGENT_MODEL": ctx.model,
        # Telemetry, error reporting, auto-update and other traffic to Anthropic's hosts off.
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
        # --dangerously-skip-permissions is refused under root unless it is told it runs in a sandbox.
        "IS_SANDBOX": "1",
    }
    argv = ["claude", "-p", "--dangerously-skip-permissions", "--model", ctx.model, "--", ctx.instruction]
    return argv, env


def _qwen_code(spec: rollout_pb2.HarnessSpec, ctx: HarnessContext) -> PresetLaunch:
    settings = {
        "security": {"auth": {"selectedType": "openai"}},
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
    }
    _write_json(ctx.home / ".qwen" / "settings.json", settings)
    # --prompt=VALUE: a separate value starting with "-" would be read as a flag.
    return ["qwen", "--yolo", "--auth-type", "openai", "-m", ctx.model, f"--prompt={ctx.instruction}"], {}


def _gemini_cli(spec: rollout_pb2.HarnessSpec, ctx: HarnessContext) -> PresetLaunch:
    settings = {
        "security": {"auth": {"selectedType": "gemini-api-key"}},
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
        "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
    }
    _write_json(ctx.home / ".gemini" / "settings.json", settings)
    # Gemini CLI exits 55 in a folder it has not been told to trust.
    env = {"GEMINI_CLI_TRUST_WORKSPACE": "true"}
    return ["gemini", "--yolo", "-m", ctx.model, f"--prompt={ctx.instruction}"], env


# Pi's provider `api` for each dialect, and the path its SDK for that API expects after the base URL
# (the OpenAI SDK appends /chat/completions or /responses, Anthropic's /v1/messages, and pi's Google
# client /models/M:streamGenerateContent, with no version of its own).
PI_APIS = {
    common_pb2.DIALECT_OPENAI_CHAT: ("openai-completions", "/v1"),
    common_pb2.DIALECT_OPENAI_RESPONSES: ("openai-responses", "/v1"),
    common_pb2.DIALECT_ANTHROPIC_MESSAGES: ("anthropic-messages", ""),
    common_pb2.DIALECT_GOOGLE_GENERATE_CONTENT: ("google-generative-ai", "/v1beta"),
}


def _pi(spec: rollout_pb2.HarnessSpec, ctx: HarnessContext) -> PresetLaunch:
    api, path = PI_APIS[PRESETS["pi"].dialect(spec)]
    provider = {
        "baseUrl": ctx.base_url + path,
        "api": api,
        "apiKey": "POLAR_SESSION_KEY",  # the name of the variable holding the key
        "models": [{"id": ctx.model}],
    }
    _write_json(ctx.home / ".pi" / "agent" / "models.json", {"providers": {"polar": provider}})
    # No startup network traffic: update checks, package update checks, install telemetry.
    env = {"PI_OFFLINE": "1"}
    # Pi has no "--": an argument starting with "-" is a flag and one starting with "@" a file to attach,
    # so such an instruction gets a leading space.
    message = " " + ctx.instruction if ctx.instruction.startswith(("-", "@")) else ctx.instruction
    return ["pi", "-p", "--provider", "polar", "--model", ctx.model, message], env


def _command(spec: rollout_pb2.HarnessSpec, ctx: HarnessContext) -> PresetLaunch:
    if not spec.command:
        raise HarnessError("preset 'command' needs harness.command (the argv to run)")
    return list(spec.command), {}


_D = common_pb2
PRESETS: dict[str, Preset] = {
    "codex": Preset("codex", "@openai/codex", ShellTool("exec_command", "cmd"), _codex, (_D.DIALECT_OPENAI_RESPONSES,)),
    "claude-code": Preset(
        "claude-code",
        "@anthropic-ai/claude-code",
        ShellTool("Bash", "command"),
        _claude_code,
        (_D.DIALECT_ANTHROPIC_MESSAGES,),
    ),
    "qwen-code": Preset(
        "qwen-code",
        "@qwen-code/qwen-code",
        ShellTool("run_shell_command", "command"),
        _qwen_code,
        (_D.DIALECT_OPENAI_CHAT,),
    ),
    "gemini-cli": Preset(
        "gemini-cli",
        "@google/gemini-cli",
        ShellTool("run_shell_command", "command"),
        _gemini_cli,
        (_D.DIALECT_GOOGLE_GENERATE_CONTENT,),
    ),
    "pi": Preset("pi", "@mariozechner/pi-coding-agent", ShellTool("bash", "command"), _pi, tuple(PI_APIS)),
    "command": Preset("command", "", None, _command),
}


# ---------------------------------------------------------------------------------------------------
# Launching
# ---------------------------------------------------------------------------------------------------


def prepare_launch(
    spec: rollout_pb2.HarnessSpec, ctx: HarnessContext, *, search_path: str = "", in_container: bool = False
) -> Launch:
    """The argv and environment that run `spec` for this session; writes the CLI's config files into
    ctx.home. `search_path` (os.pathsep-joined folders, e.g. node_modules/.bin; relative ones to this
    process's working folder, not the workspace the harness starts in) is searched for the program
    before PATH; spec.env is applied last, so a task can override anything. `in_container`:
    the harness runs in a container (the docker runtime), whose image has its own programs and PATH,
    so the program is not looked up here and PATH is left to the image."""
    preset = PRESETS.get(spec.preset)
    if preset is None:
        raise HarnessError(f"unknown harness preset {spec.preset!r} (known: {', '.join(PRESETS)})")
    ctx = replace(ctx, base_url=ctx.base_url.rstrip("/"))  # every dialect appends its own path
    folders = [os.path.abspath(folder) for folder in search_path.split(os.pathsep) if folder]
    path = os.pathsep.join(part for part in (*folders, os.environ.get("PATH", "")) if part)
    argv, preset_env = preset.build(spec, ctx)
    env = session_environment(ctx, path)
    if in_container:
        del env["PATH"]
    else:
        argv = [_resolve(argv[0], path, preset), *argv[1:]]
    return Launch(argv, {**env, **preset_env, **spec.env})


def _resolve(program: str, path: str, preset: Preset) -> str:
    if os.sep in program:
        return program  # a path (relative ones are relative to the workspace, the harness's cwd)
    found = shutil.which(program, path=path)
    if found is not None:
        return found
    if preset.package:
        raise HarnessError(
            f"the {preset.name} CLI ({program!r}) is not installed: install it with `npm install {preset.package}` "
            "and put its node_modules/.bin on the search path or PATH"
        )
    raise HarnessError(f"harness command {program!r} not found on PATH")
