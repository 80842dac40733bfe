"""Accounting a container cannot forge, detected: the node agent's metrics sum what the driver
(NVML) reports per process for each pod and flag a pod holding more than its quotas allow, whatever
its region says, and what processes of pods Tessera did not serve hold. Here the fake GPU's NVML
reports the processes; a pod's "escape" is a process that runs without the hook (as one that zeroed
or deleted its region would be counted). What the agent then does is tests/deviceplugin/test_driveruse.py's."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from deviceplugin.driveruse import GpuProcess, pod_uid_of
from deviceplugin.metrics import AgentCollector
from nodeagent.records import ServedRecord
from nodeagent.statedir import REGION_NAME, StateDir
from tessera.contract import GpuGrant, GpuInfo
from tests.hook.conftest import GIB, Clients, FakeGpus
from tests.processes import Processes

NVML_PROCESSES = Path(__file__).resolve().parent / "clients" / "nvml_processes.py"


def driver_view(gpu: FakeGpus) -> Callable[[str], tuple[GpuProcess, ...]]:
    """What NVML reports for a GPU, asked of the fake driver in a process of its own."""

    def processes(uuid: str) -> tuple[GpuProcess, ...]:
        out = subprocess.run(
            [sys.executable, str(NVML_PROCESSES), uuid],
            env=gpu.env(hooked=False),
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        return tuple(
            GpuProcess(int(pid), int(used)) for pid, used in (line.split() for line in out.splitlines())
        )

    return processes


def test_a_pod_holding_more_than_its_quota_by_nvml_is_reported(
    gpu: FakeGpus, clients: Clients, processes: Processes, tmp_path: Path
) -> None:
    state = StateDir(tmp_path / "state-dir")
    pods = {}
    for name in ("greedy", "honest"):
        where = state.container(f"uid-{name}", "main")
        grant = GpuGrant(uuid=gpu.uuids[0], memory_quota_mib=1024, cores=0)
        record = ServedRecord(
            namespace="ns", pod=name, pod_uid=f"uid-{name}", container="main", gpus=(grant,)
        )
        state.write_record(where, record)
        where.state.mkdir()
        pods[name] = where
    # The honest pod fills its 1 GiB quota through the hook; the greedy one allocates 3 GiB around it
    # (and its region, never written, says it holds nothing).
    honest = processes.start(
        [clients.dynamic, "dlsym", "alloc", "1g", "hold"],
        gpu.env(TESSERA_MEMORY_LIMIT="1g", TESSERA_REGION=str(pods["honest"].state / REGION_NAME)),
    )
    greedy = processes.start([clients.dynamic, "dlsym", "alloc", "3g", "hold"], gpu.env(hooked=False))
    # A pod Tessera never served, on the same GPU (NVIDIA_VISIBLE_DEVICES=all, no hook).
    outsider = processes.start([clients.dynamic, "dlsym", "alloc", "2g", "hold"], gpu.env(hooked=False))
    for process in (honest, greedy, outsider):
        assert process.stdout is not None
        assert [process.stdout.readline().strip() for _ in range(2)] == ["ok 0", "holding"]
    owners = {honest.pid: "uid-honest", greedy.pid: "uid-greedy", outsider.pid: "uid-outsider"}
    inventory = (
        GpuInfo(
            uuid=gpu.uuids[0],
            index=0,
            model="fake",
            total_memory_mib=8192,
            sm_count=1,
            compute_capability="8.0",
            split=4,
        ),
    )
    collector = AgentCollector(
        "node", lambda: inventory, lambda uuid: None, state, processes=driver_view(gpu), pod_of_pid=owners.get
    )
    families = {family.name: family for family in collector.collect()}
    held = {s.labels["pod"]: s.value for s in families["tessera_pod_gpu_memory_driver_bytes"].samples}
    over = {s.labels["pod"]: s.value for s in families["tessera_pod_gpu_memory_over_quota"].samples}
    assert held == {"greedy": 3 * GIB, "honest": GIB}
    assert over == {"greedy": 1.0, "honest": 0.0}
    regions = {s.labels["pod"]: s.value for s in families["tessera_container_memory_used_bytes"].samples}
    assert regions == {"greedy": 0, "honest": GIB}  # what the regions say: the greedy one looks idle
    (unmanaged,) = families["tessera_gpu_memory_unmanaged_bytes"].samples
    assert unmanaged.value == 2 * GIB and unmanaged.labels["UUID"] == gpu.uuids[0]

    Processes.stop(greedy)
    families = {family.name: family for family in collector.collect()}
    over = {s.labels["pod"]: s.value for s in families["tessera_pod_gpu_memory_over_quota"].samples}
    assert over == {"greedy": 0.0, "honest": 0.0}


def test_a_process_pod_is_read_from_its_cgroup(tmp_path: Path) -> None:
    uid = "8f6d2c1e-0000-4000-8000-000000000001"
    for pid, line in [
        (
            1,
            f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid.replace('-', '_')}.slice/cri-containerd-ab.scope\n",
        ),
        (2, f"0::/kubepods/besteffort/pod{uid}/0123abcd\n"),
        (3, "0::/system.slice/sshd.service\n"),
    ]:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cgroup").write_text(line)
    assert [pod_uid_of(pid, tmp_path) for pid in (1, 2, 3, 4)] == [uid, uid, None, None]
