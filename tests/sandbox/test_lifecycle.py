"""The sandbox's infrastructure on a real host: `up` refuses what it cannot run and cleans up after a
failed start; the demo, with a clean `down` after it; `down` where the runtime left a container frozen.
`down` after the kubelet died: test_chaos.py, last on the shared sandbox."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sandbox import cluster, host
from sandbox.controlplane import ControlPlaneError
from sandbox.layout import CGROUP_ROOT, Layout
from sandbox.processes import StartError
from tests.sandbox.conftest import HostView, differences

pytestmark = pytest.mark.sandbox


def _cli(*args: str, user: str | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "tessera.cli", "sandbox", *args]
    if user is not None:
        command = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False, cwd=Path.cwd())


def test_up_refuses_a_taken_kubelet_port_and_starts_nothing(
    sandbox_root: Path, host_before: HostView
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _cli("up", "--dir", str(sandbox_root), "--kubelet-port", str(port))
    assert result.returncode == 1
    assert f"port {port} on 127.0.0.1 is taken" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (sandbox_root / "sandbox.json").exists()
    assert differences(host_before, sandbox_root) == []


def test_up_refuses_to_run_without_root(sandbox_root: Path) -> None:
    result = _cli("up", "--dir", str(sandbox_root), user="65534")
    assert result.returncode == 1
    assert "tessera sandbox must run as root (uid 0, not 65534)" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_failed_up_stops_what_it_started_and_cleans_the_host(
    sandbox_root: Path, host_before: HostView
) -> None:
    # No time at all to wait: containerd starts, then the control plane cannot become ready in time.
    with pytest.raises(ControlPlaneError, match="not ready"):
        cluster.up(cluster.Options(root=sandbox_root, timeout=0.001), report=lambda _: None)
    assert not (sandbox_root / "sandbox.json").exists()
    assert differences(host_before, sandbox_root) == []


def test_a_failed_up_of_three_nodes_leaves_no_node_behind(sandbox_root: Path, host_before: HostView) -> None:
    # The further nodes are up (their namespaces, veths, routes, holders, kubelets) when the chart's
    # install is refused: a DaemonSet update strategy the API rejects.
    values = ("devicePlugin.updateStrategy.type=Sideways",)
    with pytest.raises(StartError, match="helm install"):
        cluster.up(cluster.Options(root=sandbox_root, nodes=3, values=values), report=lambda _: None)
    assert not (sandbox_root / "sandbox.json").exists()
    assert differences(host_before, sandbox_root) == []


def test_demo_shows_placements_quota_refusals_and_the_pending_reason_then_cleans_up(
    sandbox_root: Path, host_before: HostView
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tessera.cli", "sandbox", "demo", "--dir", str(sandbox_root)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "quota-1g   Running  node" in out and "NVIDIA A100-SXM4-40GB 1024 MiB 30%" in out
    assert "total_mib=1024" in out and "allocations_ok=4" in out and "refused_with=2" in out
    # Tessera's own pods, installed by the chart: the node agent and both scheduler replicas, ready.
    pods = [line.split() for line in out.splitlines() if line.startswith("tessera-")]
    assert sorted((p[0].rsplit("-", 2)[0] if "scheduler" in p[0] else p[0].rsplit("-", 1)[0], p[1], p[2])
                  for p in pods) == [
        ("tessera-device-plugin", "1/1", "Running"),
        ("tessera-scheduler", "2/2", "Running"),
        ("tessera-scheduler", "2/2", "Running"),
    ]  # fmt: skip
    # A user's own Python image, NVIDIA's clients inside: NVML and the driver see the quota.
    assert "nvml_total_mib=2048" in out and "driver_total_mib=2048" in out
    assert "allocations_ok=8" in out and "refused_with=CUDA_ERROR_OUT_OF_MEMORY" in out
    assert "no GPU with 81920 MiB of memory; largest has 40960 MiB" in out
    assert out.rstrip().endswith("sandbox down: nothing left on the host")
    assert differences(host_before, sandbox_root) == []


def _freezer() -> tuple[Path, str, str]:
    """The freezer: the v1 hierarchy's (file, frozen value), or cgroup v2's."""
    v1 = host.CGROUP_MOUNT / "freezer"
    if (v1 / "cgroup.procs").exists():
        return v1, "freezer.state", "FROZEN"
    return host.CGROUP_MOUNT, "cgroup.freeze", "1"


def test_down_kills_a_container_its_runtime_left_frozen(sandbox_root: Path, host_before: HostView) -> None:
    """runc freezes a container's cgroup while it changes its device rules (cgroup v1) and thaws it
    after; killed in between (the chaos test kills containerd at random, and a full run once left a
    pod's `sleep` so, SIGKILL pending for good), it leaves the container frozen. `down` thaws the
    sandbox's cgroups before it kills, and the host is clean."""
    sandbox_root.mkdir()
    host.take_snapshot(Layout(sandbox_root))  # an `up` began here: `down` cleans the host
    hierarchy, control, frozen = _freezer()
    group = hierarchy / CGROUP_ROOT / "container"
    group.mkdir(parents=True)
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        (group / "cgroup.procs").write_text(str(sleeper.pid))
        (group / control).write_text(frozen)
        deadline = time.monotonic() + 10
        while (group / control).read_text().strip() != frozen and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(sleeper.pid, signal.SIGKILL)
        time.sleep(0.5)
        assert sleeper.poll() is None, "a frozen process acted on SIGKILL: the test shows nothing"
        assert cluster.down(sandbox_root, report=lambda _: None) == []
        assert sleeper.wait(timeout=10) == -signal.SIGKILL
        assert not group.exists()
        assert differences(host_before, sandbox_root) == []
    finally:
        with contextlib.suppress(OSError):
            (group / control).write_text("THAWED" if control == "freezer.state" else "0")
        sleeper.kill()
        sleeper.wait(timeout=10)
