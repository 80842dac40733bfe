"""Flags, their environment defaults and their errors; the sysfs NUMA fallback."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from deviceplugin.config import DEFAULT_PLUGIN_DIR, parse_config
from nodeagent.nvml import sysfs_numa_node
from nodeagent.statedir import StateDir


def test_defaults() -> None:
    config = parse_config(["--node-name=n1"], environ={})
    assert config.plugin_dir == DEFAULT_PLUGIN_DIR
    assert config.split == 10
    assert config.keys.vgpu == "tessera.io/vgpu"
    assert config.kubelet_socket == DEFAULT_PLUGIN_DIR / "kubelet.sock"
    assert config.endpoint == "tessera.io-vgpu.sock"
    assert config.heartbeat_seconds == 30
    assert config.inflight_timeout == timedelta(minutes=5)
    assert config.kubeconfig is None
    assert (config.shortfall_wait_seconds, config.eviction_grace_seconds) == (30, 5)
    assert (config.usage_tick_seconds, config.oversubscription_margin_mib) == (0.1, 512)
    assert (config.usage_publish_seconds, config.usage_change_mib) == (5, 256)


def test_environment_then_flags() -> None:
    env = {
        "NODE_NAME": "from-env",
        "TESSERA_SPLIT": "4",
        "TESSERA_DOMAIN": "gpu.example.com",
        "TESSERA_STATE_DIR": "/srv/state",
        "KUBECONFIG": "/etc/kube.conf",
    }
    config = parse_config([], environ=env)
    assert (config.node_name, config.split, config.keys.vgpu) == ("from-env", 4, "gpu.example.com/vgpu")
    assert config.state_dir == Path("/srv/state") and config.kubeconfig == Path("/etc/kube.conf")
    assert parse_config(["--split=7", "--node-name=flag"], environ=env).split == 7


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "--node-name (or env NODE_NAME) is required"),
        (["--node-name=n", "--split=0"], "argument --split: '0' must be at least 1"),
        (["--node-name=n", "--split=many"], "argument --split: 'many' is not an integer"),
        (["--node-name=n", "--metrics-port=70000"], "argument --metrics-port: '70000' is outside 0..65535"),
        (
            ["--node-name=n", "--heartbeat-seconds=0"],
            "argument --heartbeat-seconds: '0' must be more than 0 seconds",
        ),
        (
            ["--node-name=n", "--domain=Not A Domain"],
            "--domain: domain: 'Not A Domain' is not a DNS subdomain",
        ),
        (
            ["--node-name=n", "--oversubscription-margin-mib=-1"],
            "argument --oversubscription-margin-mib: '-1' must be at least 0",
        ),
        (["--node-name=n", "--shortfall-wait-seconds=601"], "--shortfall-wait-seconds: 601 is more than 600"),
        (
            ["--node-name=n", "--shortfall-wait-seconds=10", "--eviction-grace-seconds=10"],
            "--eviction-grace-seconds: 10 must be less than --shortfall-wait-seconds (10)",
        ),
    ],
)
def test_bad_flags_name_the_flag_and_value(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_config(argv, environ={})
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_numa_node_from_sysfs(tmp_path: Path) -> None:
    (tmp_path / "0000:3b:00.0").mkdir()
    (tmp_path / "0000:3b:00.0" / "numa_node").write_text("1\n")
    (tmp_path / "0000:5e:00.0").mkdir()
    (tmp_path / "0000:5e:00.0" / "numa_node").write_text("-1\n")
    assert sysfs_numa_node("00000000:3B:00.0", tmp_path) == 1
    assert sysfs_numa_node("00000000:5E:00.0", tmp_path) is None  # no NUMA affinity
    assert sysfs_numa_node("00000000:AF:00.0", tmp_path) is None
    assert sysfs_numa_node("garbage", tmp_path) is None


def test_state_dir_refuses_names_that_leave_it(tmp_path: Path) -> None:
    state = StateDir(tmp_path)
    assert state.container("uid-1", "main").root == tmp_path / "containers" / "uid-1" / "main"
    for uid, container in (("..", "main"), ("uid", "../../etc"), ("uid", "")):
        with pytest.raises(ValueError, match="cannot name a directory"):
            state.container(uid, container)
