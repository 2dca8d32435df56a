"""Every service's flags come from its config dataclass: one flag per field, named by the one rule,
documented by the field's comment, and `polar up`'s command line parses back to the same config, with
only its own command's arguments built as `polar` builds them."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import pytest

from polar.app.cli import build_parser
from polar.config import ConfigError, GatewayConfig, InferenceConfig, NodeConfig, RolloutConfig, load_config, settings
from polar.service_base import Service
from polar.service_table import ENVOY, SERVICES


def _serve_parser(name: str) -> argparse.ArgumentParser:
    root = build_parser()
    serve = next(a for a in root._subparsers._group_actions if isinstance(a, argparse._SubParsersAction)).choices[
        "serve"
    ]
    return next(a for a in serve._subparsers._group_actions if isinstance(a, argparse._SubParsersAction)).choices[name]


def _parse(argv: tuple[str, ...]) -> argparse.Namespace:
    assert argv[1:4] == ("-m", "polar", "serve")
    return build_parser(argv[3:]).parse_args(argv[3:])


@pytest.mark.parametrize("service", SERVICES, ids=lambda s: s.name)
def test_every_config_field_is_a_documented_flag(service: Service):
    actions = {action.dest: action for action in _serve_parser(service.name)._actions}
    for section in service.sections:
        for setting in settings(section):
            action = actions.get(setting.name)
            assert action is not None, f"{section.__name__}.{setting.name} has no flag in `polar serve {service.name}`"
            assert action.help and action.help != argparse.SUPPRESS, f"--{setting.name} has no help"
            assert setting.help, f"{section.__name__}.{setting.name} has no comment in polar/config.py"
            explicit = [flag.name for flag in service.flags if flag.dest == setting.name]
            # The one naming rule, except the addresses of other services (--inference, --rollout).
            assert action.option_strings[0] == (explicit or ["--" + setting.name.replace("_", "-")])[0]
            if not explicit:
                assert action.help.startswith(setting.help.replace("%", "%%"))


def test_sections_of_one_service_share_no_field_name():
    for service in SERVICES:
        names = [f.name for section in service.sections for f in dataclasses.fields(section)]
        assert len(names) == len(set(names)), service.name


CHANGED = {
    "inference": (
        InferenceConfig(engine="scripted", model="m", host="0.0.0.0", port=0, max_batch_size=3, script="s.json"),
    ),
    "rollout": (RolloutConfig(port=0, store="a.db", heartbeat_interval_s=0.25, node_timeout_s=7.5, max_attempts=5),),
    "gateway": (
        GatewayConfig(
            port=0, history="template", inference_address="10.0.0.1:5", base_url="http://x", generate_timeout_s=3.5
        ),
    ),
    "node": (
        NodeConfig(rollout_address="10.0.0.2:50070", ready_slots=0, prewarm=False, harness_path="/opt/bin"),
        GatewayConfig(grpc_port=0, tokenizer="tiny", inference_address="10.0.0.1:5"),
    ),
}


@pytest.mark.parametrize("service", [s for s in SERVICES if s.name in CHANGED], ids=lambda s: s.name)
def test_the_command_line_of_a_config_parses_back_to_it(service: Service):
    configs = CHANGED[service.name]
    assert service.configs(_parse(service.argv(*configs))) == configs


def test_envoy_s_flags_that_are_not_settings_repeat_and_pass_through():
    argv = ENVOY.argv(ENVOY.sections[0](harness_port=0), inference=["a:1", "b:2"], gateway="127.0.0.1:8000")
    args = _parse(argv)
    assert (args.inference, args.gateway, args.harness_port) == (["a:1", "b:2"], "127.0.0.1:8000", 0)


def test_a_bad_value_is_refused_with_what_it_must_be():
    parser = _serve_parser("rollout")
    parser.exit = lambda status=0, message=None: (_ for _ in ()).throw(SystemExit(message))
    with pytest.raises(SystemExit, match="--port: must be a port in 0..65535, not 70000"):
        parser.parse_args(["--port", "70000"])
    with pytest.raises(SystemExit, match="--max-attempts: must be > 0, not 0"):
        parser.parse_args(["--max-attempts", "0"])


def test_a_config_file_is_held_to_the_same_checks(tmp_path):
    path = tmp_path / "stack.toml"
    for text, problem in [
        ("[rollout]\nmax_attempts = 0\n", "'rollout.max_attempts' must be > 0, not 0"),
        ("[gateway]\nport = 70000\n", "'gateway.port' must be a port in 0..65535"),
        ('[gateway]\nhistory = "all"\n', "'gateway.history' must be one of 'faithful', 'template'"),
        ('[node]\nready_slots = "2"\n', "'node.ready_slots' must be an integer, not '2'"),
        ("[gateway]\nmessage_interval_s = 2.0\n", r"'gateway.message_interval_s' must be in \[0, 1\] \(seconds\)"),
    ]:
        path.write_text(text)
        with pytest.raises(ConfigError, match=problem):
            load_config(path)


def test_a_command_line_builds_only_its_own_commands_arguments():
    """`polar serve NAME` (every service of the stack) does not pay for other commands' arguments, such
    as `polar tasks import`'s dataset flavours, which import SWE-style instance readers."""
    program = (
        "import sys; from polar.app.cli import build_parser; build_parser(sys.argv[1:]);"
        " print('polar.app.swe.instances' in sys.modules)"
    )
    imported = {
        words: subprocess.run(
            [sys.executable, "-c", program, *words], capture_output=True, text=True, check=True
        ).stdout.strip()
        for words in (("serve", "rollout"), ("version",), ("tasks", "import"))
    }
    assert imported == {("serve", "rollout"): "False", ("version",): "False", ("tasks", "import"): "True"}
