"""Each flag is declared once: the binaries that take it share its declaration (tessera/cliargs.py
for the extender's and the node agents', nodeagent/flags.py for the node agents'), so its name,
default, environment variable and help are the same in each."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

from deviceplugin import config as deviceplugin_config
from deviceplugin import mps_control
from draplugin import main as dra_main
from extender.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
# The sources of the extender's, the node agents' and `tessera status`'s command lines.
SOURCES = ("tessera/cliargs.py", "tessera/cli", "extender", "nodeagent", "deviceplugin", "draplugin")
ENV = {
    "NODE_NAME": "n1",
    "TESSERA_DOMAIN": "gpu.example.com",
    "TESSERA_STATE_DIR": "/srv/state",
    "KUBECONFIG": "/etc/kube.conf",
    "TESSERA_HOOK_LIBRARY": "/opt/libvgpu.so",
    "TESSERA_INFLIGHT_TIMEOUT": "42",
}


def declared_flags(path: Path) -> list[str]:
    """The long option of every ``add_argument`` call in ``path``."""
    return [
        node.args[0].value
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "add_argument"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
        and node.args[0].value.startswith("--")
    ]


def test_each_flag_is_declared_once() -> None:
    where: dict[str, list[str]] = {}
    for source in SOURCES:
        root = ROOT / source
        for path in [root] if root.is_file() else sorted(root.rglob("*.py")):
            for flag in declared_flags(path):
                where.setdefault(flag, []).append(str(path.relative_to(ROOT)))
    assert {flag: paths for flag, paths in where.items() if len(paths) > 1} == {}
    assert {"--domain", "--kubeconfig", "--inflight-timeout", "--node-name", "--state-dir"} <= set(where)


def action(parser: argparse.ArgumentParser, flag: str) -> tuple[object, ...]:
    [found] = [a for a in parser._actions if flag in a.option_strings]
    return found.default, found.type, found.help


@pytest.mark.parametrize("flag", ["--node-name", "--domain", "--state-dir", "--kubeconfig"])
def test_the_node_binaries_take_the_node_flags_alike(flag: str) -> None:
    plugin = action(deviceplugin_config.parser(ENV), flag)
    assert action(mps_control.parser(ENV), flag) == plugin
    assert action(dra_main.parser(ENV), flag) == plugin


def test_both_agents_take_the_hook_library_alike() -> None:
    plugin = action(deviceplugin_config.parser(ENV), "--hook-library")
    assert plugin[0] == Path("/opt/libvgpu.so")
    assert action(dra_main.parser(ENV), "--hook-library") == plugin


@pytest.mark.parametrize("flag", ["--metrics-address", "--metrics-port", "--metrics-authorization"])
def test_both_agents_serve_metrics_alike(flag: str) -> None:
    plugin = action(deviceplugin_config.parser(ENV), flag)
    assert action(dra_main.parser(ENV), flag) == plugin


def test_the_dra_drivers_metrics_default_to_the_device_plugins_port_reviewed() -> None:
    config = dra_main.parse_config([], ENV)
    assert (config.metrics.address, config.metrics.port, config.metrics.authorization) == (
        "127.0.0.1",
        9401,
        True,
    )
    opened = dra_main.parse_config(["--metrics-port=0", "--metrics-authorization=none"], ENV)
    assert (opened.metrics.port, opened.metrics.authorization) == (0, False)


def test_the_extender_and_the_agents_share_their_common_flags() -> None:
    extender = build_parser(ENV)
    plugin = deviceplugin_config.parser(ENV)
    assert action(extender, "--domain") == action(plugin, "--domain")
    # The extender's --kubeconfig and --inflight-timeout take no default from the environment.
    assert action(extender, "--kubeconfig")[:2] == (None, Path)
    assert action(plugin, "--kubeconfig")[:2] == ("/etc/kube.conf", Path)
    assert extender.parse_args([]).inflight_timeout == 300
    assert plugin.parse_args([]).inflight_timeout == 42
    for parser in (extender, plugin):
        assert parser.parse_args(["--kubeconfig", "/k"]).kubeconfig == Path("/k")


def test_the_extenders_domain_is_the_environments_without_the_flag() -> None:
    assert build_parser({}).parse_args([]).domain == "tessera.io"
    assert build_parser({"TESSERA_DOMAIN": "gpu.example.com"}).parse_args([]).domain == "gpu.example.com"
