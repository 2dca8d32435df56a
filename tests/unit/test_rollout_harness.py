"""Harness presets (polar/rollout/harness.py): what each one launches and writes, for one session.

The CLIs are stand-in executables on the search path (the real ones run in scripts/record_session.py
and the e2e tier); everything the presets build (argv, environment, config files) is checked as the
CLIs would read it.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest

from polar.rollout.harness import PRESETS, HarnessContext, HarnessError, prepare_launch
from polar.rollout.tasks import HARNESS_PRESETS
from polar.v1 import common_pb2, rollout_pb2

BASE_URL = "http://127.0.0.1:18080"
KEY = "polar-session-key-0123456789"
MODEL = "Qwen/Qwen3-4B"
CLI_PRESETS = [name for name in PRESETS if name != "command"]
PROGRAMS = {"codex": "codex", "claude-code": "claude", "qwen-code": "qwen", "gemini-cli": "gemini", "pi": "pi"}
PROXY_VARIABLES = (
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
    "all_proxy",
    "no_proxy",
)


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    """A folder with a stand-in executable for every preset's CLI."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for program in PROGRAMS.values():
        path = folder / program
        path.write_text("#!/bin/sh\nexit 0\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return folder


@pytest.fixture
def ctx(tmp_path: Path) -> HarnessContext:
    home, workspace = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    workspace.mkdir()
    return HarnessContext(
        instruction="Create hello.txt containing hello.",
        base_url=BASE_URL,
        key=KEY,
        model=MODEL,
        home=home,
        workspace=workspace,
        session_id="task-1.0",
        task_id="task-1",
    )


@pytest.fixture(autouse=True)
def node_environment(monkeypatch):
    """The node's own environment holds proxies and real-looking keys; none of it may reach a harness."""
    for name in PROXY_VARIABLES:
        monkeypatch.setenv(name, "http://proxy.example:3128")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-real-key")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", "https://api.anthropic.com")
    monkeypatch.setenv("SOME_NODE_SETTING", "node-only")


def launch_for(preset: str, ctx: HarnessContext, bin_dir: Path, **spec_fields):
    return prepare_launch(rollout_pb2.HarnessSpec(preset=preset, **spec_fields), ctx, search_path=str(bin_dir))


def home_files(ctx: HarnessContext) -> dict[str, str]:
    return {str(p.relative_to(ctx.home)): p.read_text() for p in sorted(ctx.home.rglob("*")) if p.is_file()}


def test_presets_are_the_task_schemas_presets():
    assert tuple(PRESETS) == HARNESS_PRESETS


@pytest.mark.parametrize("preset", CLI_PRESETS)
def test_cli_is_found_on_the_search_path_first(preset, ctx, bin_dir, tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    decoy = elsewhere / PROGRAMS[preset]
    decoy.write_text("#!/bin/sh\n")
    decoy.chmod(0o755)
    monkeypatch.setenv("PATH", str(elsewhere))
    launch = launch_for(preset, ctx, bin_dir)
    assert launch.argv[0] == str(bin_dir / PROGRAMS[preset])
    assert launch.env["PATH"].split(os.pathsep)[:2] == [str(bin_dir), str(elsewhere)]


def test_a_relative_search_path_is_the_node_s_not_the_workspace_s(ctx, bin_dir, monkeypatch):
    # The harness starts in its workspace: a relative folder on its PATH would be looked up there.
    monkeypatch.chdir(bin_dir.parent)
    launch = prepare_launch(rollout_pb2.HarnessSpec(preset="pi"), ctx, search_path=bin_dir.name)
    assert launch.argv[0] == str(bin_dir / PROGRAMS["pi"])
    assert launch.env["PATH"].split(os.pathsep)[0] == str(bin_dir)


@pytest.mark.parametrize("preset", PRESETS)
def test_environment_is_built_from_scratch(preset, ctx, bin_dir):
    launch = launch_for(preset, ctx, bin_dir, command=["sh", "-c", "true"])
    env = launch.env
    assert not set(PROXY_VARIABLES) & set(env)
    assert "SOME_NODE_SETTING" not in env
    assert env["HOME"] == str(ctx.home)
    assert (env["TERM"], env["NO_COLOR"], env["CI"]) == ("dumb", "1", "1")
    assert env["POLAR_INSTRUCTION"] == ctx.instruction
    assert (env["POLAR_SESSION_ID"], env["POLAR_TASK_ID"], env["POLAR_MODEL"]) == ("task-1.0", "task-1", MODEL)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_base_url_is_the_gateway_and_every_key_the_session_key(preset, ctx, bin_dir):
    env = launch_for(preset, ctx, bin_dir, command=["sh", "-c", "true"]).env
    urls = {name: value for name, value in env.items() if name.endswith(("_BASE_URL", "_API_BASE"))}
    keys = {name: value for name, value in env.items() if name.endswith(("_API_KEY", "_SESSION_KEY"))}
    assert {"OPENAI_BASE_URL", "ANTHROPIC_BASE_URL", "GOOGLE_GEMINI_BASE_URL", "POLAR_BASE_URL"} <= set(urls)
    assert {"OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY", "GOOGLE_API_KEY", "POLAR_SESSION_KEY"} <= set(keys)
    assert all(url == BASE_URL or url == BASE_URL + "/v1" for url in urls.values()), urls
    assert set(keys.values()) == {KEY}
    # SDKs append their own paths: OpenAI's after /v1, Anthropic's and Google's after the bare host.
    assert env["OPENAI_BASE_URL"] == BASE_URL + "/v1"
    assert env["ANTHROPIC_BASE_URL"] == env["GOOGLE_GEMINI_BASE_URL"] == BASE_URL


@pytest.mark.parametrize("preset", PRESETS)
def test_a_trailing_slash_on_the_base_url_is_dropped(preset, ctx, bin_dir):
    env = launch_for(preset, replace(ctx, base_url=BASE_URL + "/"), bin_dir, command=["sh"]).env
    assert (env["OPENAI_BASE_URL"], env["ANTHROPIC_BASE_URL"]) == (BASE_URL + "/v1", BASE_URL)


@pytest.mark.parametrize("preset", CLI_PRESETS)
def test_config_files_name_no_host_but_the_gateway(preset, ctx, bin_dir):
    launch_for(preset, ctx, bin_dir)
    for name, text in home_files(ctx).items():
        for url in re.findall(r"https?://[^\s\"']+", text):
            assert url.startswith(BASE_URL), f"{name} names {url}"


@pytest.mark.parametrize("preset", PRESETS)
def test_spec_env_overrides_everything(preset, ctx, bin_dir):
    env = launch_for(
        preset,
        ctx,
        bin_dir,
        command=["sh"],
        env={"OPENAI_BASE_URL": "http://127.0.0.1:1/v1", "EXTRA": "yes", "HOME": "/h"},
    ).env
    assert (env["OPENAI_BASE_URL"], env["EXTRA"], env["HOME"]) == ("http://127.0.0.1:1/v1", "yes", "/h")


def test_codex_uses_a_responses_provider_at_the_gateway(ctx, bin_dir):
    launch = launch_for("codex", ctx, bin_dir)
    assert launch.argv[1:] == [
        "exec",
        "--skip-git-repo-check",
        "--dangerously-bypass-approvals-and-sandbox",
        "--",
        ctx.instruction,
    ]
    codex_home = Path(launch.env["CODEX_HOME"])
    assert codex_home == ctx.home / ".codex"
    config = tomllib.loads((codex_home / "config.toml").read_text())
    assert config["model"] == MODEL
    provider = config["model_providers"][config["model_provider"]]
    assert provider["base_url"] == BASE_URL + "/v1"
    assert provider["wire_api"] == "responses"
    assert launch.env[provider["env_key"]] == KEY
    assert config["analytics"] == {"enabled": False}


def test_codex_is_told_the_served_model_s_context_window_when_it_is_known(ctx, bin_dir):
    def config(context: HarnessContext) -> dict:
        launch = launch_for("codex", context, bin_dir)
        return tomllib.loads((Path(launch.env["CODEX_HOME"]) / "config.toml").read_text())

    # Codex has no metadata for a model outside its catalog and would assume its own window (272k).
    assert config(replace(ctx, context_length=131072))["model_context_window"] == 131072
    assert "model_context_window" not in config(ctx)  # not known: Codex's own guess stands


def test_codex_config_carries_any_model_name_verbatim(ctx, bin_dir):
    odd = 'model "quoted" \\ back\u00e9'
    launch = launch_for("codex", replace(ctx, model=odd), bin_dir)
    config = tomllib.loads((Path(launch.env["CODEX_HOME"]) / "config.toml").read_text())
    assert config["model"] == odd


def test_claude_code_runs_headless_with_permissions_bypassed(ctx, bin_dir):
    launch = launch_for("claude-code", ctx, bin_dir)
    assert launch.argv[1:] == ["-p", "--dangerously-skip-permissions", "--model", MODEL, "--", ctx.instruction]
    env = launch.env
    assert env["ANTHROPIC_BASE_URL"] == BASE_URL  # it appends /v1/messages itself
    assert env["IS_SANDBOX"] == "1"  # else the bypass is refused under root
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    aliases = (
        "ANTHROPIC_MODEL",
        "ANTHROPIC_SMALL_FAST_MODEL",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL",
        "CLAUDE_CODE_SUBAGENT_MODEL",
    )
    assert {env[name] for name in aliases} == {MODEL}


def test_qwen_code_uses_openai_auth(ctx, bin_dir):
    launch = launch_for("qwen-code", ctx, bin_dir)
    assert launch.argv[1:] == ["--yolo", "--auth-type", "openai", "-m", MODEL, f"--prompt={ctx.instruction}"]
    settings = json.loads((ctx.home / ".qwen" / "settings.json").read_text())
    assert settings["security"]["auth"]["selectedType"] == "openai"
    assert settings["telemetry"]["enabled"] is False
    assert launch.env["OPENAI_MODEL"] == MODEL


def test_gemini_cli_uses_api_key_auth_in_a_trusted_workspace(ctx, bin_dir):
    launch = launch_for("gemini-cli", ctx, bin_dir)
    assert launch.argv[1:] == ["--yolo", "-m", MODEL, f"--prompt={ctx.instruction}"]
    settings = json.loads((ctx.home / ".gemini" / "settings.json").read_text())
    assert settings["security"]["auth"]["selectedType"] == "gemini-api-key"
    assert settings["telemetry"]["enabled"] is False
    assert settings["general"]["disableAutoUpdate"] is True
    assert launch.env["GEMINI_CLI_TRUST_WORKSPACE"] == "true"


def test_pi_gets_a_provider_for_the_served_model(ctx, bin_dir):
    launch = launch_for("pi", ctx, bin_dir)
    assert launch.argv[1:] == ["-p", "--provider", "polar", "--model", MODEL, ctx.instruction]
    models = json.loads((ctx.home / ".pi" / "agent" / "models.json").read_text())
    provider = models["providers"]["polar"]
    assert provider["baseUrl"] == BASE_URL + "/v1"
    assert provider["api"] == "openai-completions"
    assert launch.env[provider["apiKey"]] == KEY  # apiKey names the variable holding the key
    assert [model["id"] for model in provider["models"]] == [MODEL]
    assert launch.env["PI_OFFLINE"] == "1"


@pytest.mark.parametrize(
    "dialect, api, path",
    [
        (common_pb2.DIALECT_OPENAI_CHAT, "openai-completions", "/v1"),
        (common_pb2.DIALECT_OPENAI_RESPONSES, "openai-responses", "/v1"),
        (common_pb2.DIALECT_ANTHROPIC_MESSAGES, "anthropic-messages", ""),
        (common_pb2.DIALECT_GOOGLE_GENERATE_CONTENT, "google-generative-ai", "/v1beta"),
    ],
)
def test_pi_speaks_the_dialect_its_task_names(dialect, api, path, ctx, bin_dir):
    launch_for("pi", ctx, bin_dir, dialect=dialect)
    provider = json.loads((ctx.home / ".pi" / "agent" / "models.json").read_text())["providers"]["polar"]
    assert (provider["api"], provider["baseUrl"]) == (api, BASE_URL + path)
    assert PRESETS["pi"].dialect(rollout_pb2.HarnessSpec(preset="pi", dialect=dialect)) == dialect


def test_each_preset_s_default_dialect_is_its_first():
    defaults = {name: preset.dialect(rollout_pb2.HarnessSpec(preset=name)) for name, preset in PRESETS.items()}
    assert defaults == {
        "codex": common_pb2.DIALECT_OPENAI_RESPONSES,
        "claude-code": common_pb2.DIALECT_ANTHROPIC_MESSAGES,
        "qwen-code": common_pb2.DIALECT_OPENAI_CHAT,
        "gemini-cli": common_pb2.DIALECT_GOOGLE_GENERATE_CONTENT,
        "pi": common_pb2.DIALECT_OPENAI_CHAT,
        "command": common_pb2.DIALECT_UNSPECIFIED,
    }


@pytest.mark.parametrize("preset", CLI_PRESETS)
@pytest.mark.parametrize("instruction", ["- fix the bug\n- add a test", "--help", "@notes.md summarise"])
def test_an_instruction_that_looks_like_a_flag_stays_an_instruction(preset, instruction, ctx, bin_dir):
    argv = launch_for(preset, replace(ctx, instruction=instruction), bin_dir).argv
    last = argv[-1]
    if last.startswith("--prompt="):
        assert last == f"--prompt={instruction}"
    elif argv[-2] == "--":
        assert last == instruction
    else:  # no "--" in Pi: a leading space keeps it a message
        assert last == " " + instruction


def test_command_runs_as_given(ctx, bin_dir):
    launch = launch_for("command", ctx, bin_dir, command=["sh", "-c", 'echo "$POLAR_INSTRUCTION"'])
    assert Path(launch.argv[0]).name == "sh" and Path(launch.argv[0]).is_absolute()
    assert launch.argv[1:] == ["-c", 'echo "$POLAR_INSTRUCTION"']
    assert home_files(ctx) == {}


def test_command_with_a_path_is_left_to_the_workspace(ctx, bin_dir):
    launch = launch_for("command", ctx, bin_dir, command=["./run_agent.py", "--fast"])
    assert launch.argv == ["./run_agent.py", "--fast"]


def test_command_needs_a_command(ctx, bin_dir):
    with pytest.raises(HarnessError, match="harness.command"):
        launch_for("command", ctx, bin_dir)


def test_missing_command_program_is_named(ctx, bin_dir):
    with pytest.raises(HarnessError, match="no-such-agent"):
        launch_for("command", ctx, bin_dir, command=["no-such-agent"])


@pytest.mark.parametrize("preset", CLI_PRESETS)
def test_missing_cli_names_its_npm_package(preset, ctx, tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(HarnessError, match=re.escape(f"npm install {PRESETS[preset].package}")):
        prepare_launch(rollout_pb2.HarnessSpec(preset=preset), ctx, search_path=str(empty))


@pytest.mark.parametrize("preset", ["", "claude", "Codex"])
def test_unknown_preset_lists_the_known_ones(preset, ctx, bin_dir):
    with pytest.raises(HarnessError) as raised:
        launch_for(preset, ctx, bin_dir)
    assert all(name in str(raised.value) for name in PRESETS)


@pytest.mark.parametrize("preset", CLI_PRESETS)
def test_every_cli_preset_names_its_shell_tool(preset):
    tool = PRESETS[preset].shell_tool
    assert tool.call("echo hi") == {"name": tool.name, "arguments": {tool.command_argument: "echo hi"}}


@pytest.mark.parametrize("preset", CLI_PRESETS)
def test_in_a_container_the_image_finds_the_cli_on_its_own_path(preset, ctx):
    """The docker runtime: the CLI lives in the image, not on this host, and the image's PATH stays."""
    launch = prepare_launch(rollout_pb2.HarnessSpec(preset=preset), ctx, in_container=True)
    assert launch.argv[0] == PROGRAMS[preset]
    assert "PATH" not in launch.env
    assert launch.env["POLAR_SESSION_KEY"] == KEY and launch.env["HOME"] == str(ctx.home)
