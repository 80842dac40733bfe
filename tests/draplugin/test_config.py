"""tessera-dra's flags, their environment defaults and their errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from draplugin.main import parse_config
from tessera.placement.qos import QosThresholds

REPO = Path(__file__).resolve().parents[2]


def test_defaults_and_sockets() -> None:
    config = parse_config(["--node-name=n1"], environ={})
    assert config.dra_socket == Path("/var/lib/kubelet/plugins/tessera.io/dra.sock")
    assert config.registration_socket == Path("/var/lib/kubelet/plugins_registry/tessera.io-reg.sock")
    assert config.cdi_dir == Path("/var/run/cdi")
    assert config.state_dir == Path("/var/lib/tessera")
    assert config.resync_seconds == 30
    assert config.profiles.model_key("NVIDIA A100-SXM4-40GB") is None  # no profiles: NVML names


def test_environment_then_flags() -> None:
    env = {
        "NODE_NAME": "from-env",
        "TESSERA_DOMAIN": "gpu.example.com",
        "TESSERA_KUBELET_DIR": "/srv/kubelet",
        "TESSERA_SPEED_PROFILES": str(REPO / "deploy" / "speed-profiles.yaml"),
    }
    config = parse_config([], environ=env)
    assert config.node_name == "from-env"
    assert config.dra_socket == Path("/srv/kubelet/plugins/gpu.example.com/dra.sock")
    assert config.profiles.model_key("NVIDIA A100-SXM4-40GB") == "A100"
    assert parse_config(["--node-name=flag"], environ=env).node_name == "flag"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "--node-name (or env NODE_NAME) is required"),
        (["--node-name=n", "--domain=Bad_Domain"], "--domain: domain: 'Bad_Domain'"),
        (["--node-name=n", "--speed-profiles=/nonexistent.yaml"], "--speed-profiles: "),
        (["--node-name=n", "--resync-seconds=-1"], "--resync-seconds"),
    ],
)
def test_bad_input_exits_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_config(argv, environ={})
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_speed_profiles_are_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profiles = tmp_path / "profiles.yaml"
    profiles.write_text("models: {A100: fast}\n")
    with pytest.raises(SystemExit):
        parse_config(["--node-name=n", f"--speed-profiles={profiles}"], environ={})
    assert (
        "--speed-profiles: speed profiles: models.A100: 'fast' is not a positive number"
        in capsys.readouterr().err
    )


def test_the_qos_flags_are_the_extenders() -> None:
    """The priorities that grant a claim's class, and the namespaces that may ask for any: the same
    flags as the extender's (tessera/cliargs.py), which the chart sets from extender.qos."""
    assert parse_config(["--node-name=n"], environ={}).qos == QosThresholds()
    config = parse_config(
        [
            "--node-name=n",
            "--qos-latency-critical-priority=1000",
            "--qos-best-effort-priority=-5",
            "--qos-latency-critical-namespaces=serving, infra",
        ],
        environ={},
    )
    assert config.qos == QosThresholds(1000, -5, frozenset({"serving", "infra"}))


def test_qos_priorities_in_the_wrong_order_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_config(["--node-name=n", "--qos-best-effort-priority=2000000"], environ={})
    assert (
        "the best-effort priority (2000000) must be below the latency-critical priority"
        in capsys.readouterr().err
    )
