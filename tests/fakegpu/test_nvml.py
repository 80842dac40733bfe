"""The fake libnvidia-ml.so.1 under nvidia-ml-py: the configured GPUs, memory and processes shared
with libcuda users, runtime visibility, XID events and lost GPUs driven from the state dir."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fakegpu import BUILD_DIR, inject_xid, set_lost
from tessera.contract import CONTAINER_DEVICE_LIST_DIR
from tests.fakegpu.conftest import NVML_PROBE, ClientProcesses, Gpus

CUCLIENT = BUILD_DIR / "cuclient"
MIB = 2**20


def nvml_bus_id(pci: str) -> str:
    domain, bus, rest = pci.split(":")
    return f"{int(domain, 16):08X}:{bus.upper()}:{rest.upper()}"


def test_pynvml_reports_the_configured_gpus(gpus: Gpus, procs: ClientProcesses) -> None:
    report = json.loads(procs.probe(gpus.env(), "inventory")[0])
    assert report["driver"] == "580.95.05"
    assert report["cuda"] == 13000
    a100, h100 = gpus.specs
    assert report["gpus"] == [
        {
            "index": 0,
            "name": a100.model,
            "uuid": a100.uuid,
            "memory_total": a100.total_memory_mib * MIB,
            "memory_used": 0,
            "pci": nvml_bus_id(a100.pci_bus_id),
            "cc": [8, 0],
            "sms": 108,
            "numa": 0,
            "nvlinks": [nvml_bus_id(h100.pci_bus_id)],
        },
        {
            "index": 1,
            "name": h100.model,
            "uuid": h100.uuid,
            "memory_total": h100.total_memory_mib * MIB,
            "memory_used": 0,
            "pci": nvml_bus_id(h100.pci_bus_id),
            "cc": [9, 0],
            "sms": 132,
            "numa": None,
            "nvlinks": [],
        },
    ]


def test_nvml_ignores_cuda_visible_devices_but_not_the_runtime(gpus: Gpus, procs: ClientProcesses) -> None:
    names = [
        g["name"] for g in json.loads(procs.probe(gpus.env(CUDA_VISIBLE_DEVICES="1"), "inventory")[0])["gpus"]
    ]
    assert names == [spec.model for spec in gpus.specs]
    env = gpus.env(NVIDIA_VISIBLE_DEVICES=gpus.specs[1].uuid)
    assert [g["uuid"] for g in json.loads(procs.probe(env, "inventory")[0])["gpus"]] == [gpus.specs[1].uuid]


def test_the_runtime_s_volume_mounts_device_list_names_the_gpus(gpus: Gpus, procs: ClientProcesses) -> None:
    """NVIDIA_VISIBLE_DEVICES naming the volume-mounts directory (the device plugin's
    --device-list-strategy volume-mounts): the container has the GPUs its entries name. In a mount
    namespace of its own with /run on a tmpfs, so nothing is left on the host."""
    entry = f"{CONTAINER_DEVICE_LIST_DIR}/{gpus.specs[1].uuid}"
    script = (
        f'mount -t tmpfs tmpfs /run && mkdir -p {CONTAINER_DEVICE_LIST_DIR} && touch {entry} && exec "$@"'
    )
    env = gpus.env(NVIDIA_VISIBLE_DEVICES=CONTAINER_DEVICE_LIST_DIR)
    done = procs.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            "sh",
            sys.executable,
            str(NVML_PROBE),
            "inventory",
        ],
        env,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert [g["uuid"] for g in json.loads(done.lines[0])["gpus"]] == [gpus.specs[1].uuid]


def test_memory_and_processes_come_from_cuda_users(gpus: Gpus, procs: ClientProcesses) -> None:
    holder = procs.start([CUCLIENT, "--device", "1", "alloc", "mem", "384m", "1", "hold"], gpus.env())
    procs.expect(holder, "alloc")
    procs.expect(holder, "hold ready")
    memory, processes, idle = (
        json.loads(line)
        for line in procs.probe(gpus.env(), "memory", "1", "processes", "1", "processes", "0")
    )
    assert memory == {"total": 1024 * MIB, "used": 384 * MIB, "free": 640 * MIB}
    assert processes == [{"pid": holder.pid, "used": 384 * MIB}]
    assert idle == []
    assert holder.stdin is not None
    holder.stdin.close()  # ends "hold": the client exits without freeing
    holder.wait(timeout=30)
    memory, processes = (
        json.loads(line) for line in procs.probe(gpus.env(), "memory", "1", "processes", "1")
    )
    assert memory["used"] == 0
    assert processes == []


def _child_of(pid: int) -> int:
    """The one child of ``pid`` (``unshare --fork`` runs the command as its child)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    assert len(children) == 1, f"process {pid} has children {children}"
    return int(children[0])


def test_a_process_in_another_pid_namespace_is_reported_by_the_callers_pid(
    gpus: Gpus, procs: ClientProcesses
) -> None:
    """As the real driver reports host pids: a container's process (here: PID 1 of a new PID
    namespace) is listed under the pid the caller sees it by, which is what a node agent with hostPID
    looks up in /proc; a caller in a namespace that cannot see it gets pid 0, never another process."""
    holder = procs.start(
        [
            "unshare",
            "--pid",
            "--fork",
            "--kill-child",
            CUCLIENT,
            "--device",
            "1",
            "alloc",
            "mem",
            "256m",
            "1",
            "hold",
        ],
        gpus.env(),
    )
    procs.expect(holder, "alloc")
    procs.expect(holder, "hold ready")
    inner = _child_of(holder.pid)
    (processes,) = (json.loads(line) for line in procs.probe(gpus.env(), "processes", "1"))
    assert processes == [{"pid": inner, "used": 256 * MIB}]
    hidden = procs.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, NVML_PROBE, "processes", "1"],
        gpus.env(),
        timeout=60,
    )
    assert hidden.returncode == 0, hidden.stderr
    assert [json.loads(line) for line in hidden.lines] == [[{"pid": 0, "used": 256 * MIB}]]


def test_an_injected_xid_reaches_nvml_event_sets(gpus: Gpus, procs: ClientProcesses) -> None:
    waiter = procs.start([sys.executable, NVML_PROBE, "xid-wait", "0", "20000"], gpus.env())
    assert json.loads(procs.expect(waiter, "{")) == {"registered": gpus.specs[0].uuid}
    inject_xid(gpus.state, gpus.specs[1].uuid, 31)  # another GPU: not delivered to this set
    inject_xid(gpus.state, gpus.specs[0].uuid, 79)
    event = json.loads(procs.expect(waiter, "{"))
    assert event == {"xid": 79, "uuid": gpus.specs[0].uuid, "type": 8}


def test_xids_from_before_registration_are_not_delivered(gpus: Gpus, procs: ClientProcesses) -> None:
    inject_xid(gpus.state, gpus.specs[0].uuid, 48)
    lines = procs.probe(gpus.env(), "xid-wait", "0", "200")
    assert json.loads(lines[1]) == {"timeout": True}


def test_a_lost_gpu_answers_gpu_is_lost_until_it_recovers(gpus: Gpus, procs: ClientProcesses) -> None:
    set_lost(gpus.state, gpus.specs[1].uuid, True)
    lost, healthy = (json.loads(line) for line in procs.probe(gpus.env(), "lost", "1", "lost", "0"))
    assert lost["code"] == "15"  # NVML_ERROR_GPU_IS_LOST
    assert "fallen off the bus" in lost["error"]
    assert healthy == {"error": "ok"}
    set_lost(gpus.state, gpus.specs[1].uuid, False)
    assert json.loads(procs.probe(gpus.env(), "lost", "1")[0]) == {"error": "ok"}
