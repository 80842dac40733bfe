"""The invariant of best-effort pods that borrow GPU memory, under random load on the fake GPU: a
guaranteed container's allocation up to its quota never fails because of a best-effort neighbour.

Real hooked processes run as the containers would (each in its own mount namespace, its limits and
state dirs mounted where the hook looks for them), the node agent's usage checks run as in the
agent, and a stand-in for the API server "evicts" a pod by killing its processes (the kubelet's
part). Best-effort containers allocate and free at random against their dynamic quotas; the
guaranteed container walks at random within its quota and must never be refused. The agent reads
the GPU's free memory from the fake GPU's NVML, as in a node, to confirm a shortage before it evicts."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deviceplugin.config import parse_config
from deviceplugin.driverchecks import Driver
from deviceplugin.main import NodeAgent, compose
from deviceplugin.usage import EVICTED_REASON
from nodeagent.records import ServedRecord
from nodeagent.statedir import ContainerDir, StateDir, create_state_dir
from tessera.contract import (
    CONTAINER_LIMITS_DIR,
    CONTAINER_STATE_DIR,
    GpuGrant,
    GpuInfo,
    QosClass,
    parse_gpu_usage,
)
from tests.hook.conftest import Clients, FakeGpus, write_fake_gpus
from tests.processes import Processes
from tests.waiting import wait_for

NVML_MEMORY = Path(__file__).resolve().parent / "clients" / "nvml_memory_server.py"
GPU_MIB = 4096
GRANT_MIB = 3072
BLOCK_MIB = 256
NODE = "n1"


class EvictingKube:
    """The API server and kubelet as far as the usage checks need them: node annotations, events,
    and a pod delete that kills the pod's processes."""

    def __init__(self) -> None:
        self.node: dict[str, str] = {}
        self.events: list[tuple[str, str, str]] = []
        self.deleted: list[str] = []
        self.processes: dict[str, list[subprocess.Popen[str]]] = {}

    def node_annotations(self) -> dict[str, str]:
        return dict(self.node)

    def annotate_node(self, annotations: dict[str, str]) -> None:
        self.node.update(annotations)

    def delete_pod(self, namespace: str, name: str, uid: str, grace_seconds: int) -> None:
        self.deleted.append(name)
        for process in self.processes.get(uid, []):
            process.kill()

    def warn(self, pod: Any, reason: str, message: str) -> None:
        self.events.append((pod.name, reason, message))


def driver_free_memory(gpu: FakeGpus, processes: Processes) -> Callable[[str], int | None]:
    """The GPU's free memory by the fake GPU's NVML, from a process asked over a pipe."""
    server = processes.start([sys.executable, str(NVML_MEMORY)], gpu.env(hooked=False))
    lock = threading.Lock()

    def free(uuid: str) -> int | None:
        assert server.stdin is not None and server.stdout is not None
        with lock:
            server.stdin.write(uuid + "\n")
            server.stdin.flush()
            return int(server.stdout.readline().split()[0])

    return free


def serve(state: StateDir, gpu: FakeGpus, name: str, qos: QosClass, served_at: float) -> ContainerDir:
    where = state.container(f"uid-{name}", "main")
    create_state_dir(where)
    grant = GpuGrant(
        uuid=gpu.uuids[0], memory_quota_mib=GRANT_MIB, cores=0, oversubscribed=qos == QosClass.BEST_EFFORT
    )
    record = ServedRecord(
        namespace="ml",
        pod=name,
        pod_uid=f"uid-{name}",
        container="main",
        gpus=(grant,),
        qos=qos,
        served_at=served_at,
    )
    state.write_record(where, record)
    return where


def in_container(where: ContainerDir, argv: list[str]) -> list[str]:
    """argv in a mount namespace of its own with the container's dirs where the hook looks."""
    script = (
        "mount -t tmpfs tessera /run && mkdir -p $0 $1 && mount --bind $2 $0 && mount --bind $3 $1 && "
        'shift 3 && exec "$@"'
    )
    return [
        "unshare", "-m", "--propagation", "private", "sh", "-c", script,
        CONTAINER_STATE_DIR, CONTAINER_LIMITS_DIR, str(where.state), str(where.limits_dir), *argv,
    ]  # fmt: skip


def used_mib(agent: NodeAgent) -> int:
    usage = agent.usage.measured_usage()
    return 0 if usage is None else usage.gpus[0].memory_used_mib


def guaranteed_walk(rng: random.Random, steps: int) -> list[str]:
    """Random allocations and frees of one block, never above the quota: each allocation must succeed."""
    held: list[int] = []
    made = 0
    script: list[str] = []
    for _ in range(steps):
        if held and (len(held) * BLOCK_MIB >= GRANT_MIB or rng.random() < 0.4):
            script += ["free", str(held.pop(rng.randrange(len(held))))]
        else:
            script += ["alloc", f"{BLOCK_MIB}m"]
            held.append(made)
            made += 1
        script += ["sleep-ms", str(rng.randrange(5, 40))]
    return script


def best_effort_load(rng: random.Random, steps: int) -> list[str]:
    """Greedy random use: allocations (refused or not: the client goes on) and frees of earlier ones."""
    script: list[str] = []
    for i in range(steps):
        if i and rng.random() < 0.3:
            script += ["free", str(rng.randrange(i))]  # one refused or freed already answers an error
        else:
            script += ["alloc", f"{BLOCK_MIB}m"]
        script += ["sleep-ms", str(rng.randrange(2, 20))]
    return [*script, "hold"]


def test_a_guaranteed_allocation_within_quota_never_fails_beside_borrowers(
    tmp_path: Path, clients: Clients, processes: Processes
) -> None:
    gpu = write_fake_gpus(tmp_path, 1, memory_gib=GPU_MIB // 1024)
    state = StateDir(tmp_path / "node")
    state.prepare()
    borrowers = [serve(state, gpu, f"be-{i}", QosClass.BEST_EFFORT, served_at=float(i)) for i in range(3)]
    standard = serve(state, gpu, "standard", QosClass.STANDARD, served_at=10.0)
    config = parse_config(
        [
            f"--node-name={NODE}",
            f"--state-dir={state.root}",
            "--hook-library=/opt/libvgpu.so",
            "--usage-tick-seconds=0.05",
            f"--oversubscription-margin-mib={BLOCK_MIB}",
            "--shortfall-wait-seconds=120",
            "--eviction-grace-seconds=0",
        ],
        environ={},
    )
    info = GpuInfo(
        uuid=gpu.uuids[0],
        index=0,
        model="Fake",
        total_memory_mib=GPU_MIB,
        sm_count=80,
        compute_capability="8.0",
        split=4,
    )
    kube = EvictingKube()
    kube_any: Any = kube
    agent = compose(
        config,
        (info,),
        kube_any,
        state,
        pod_resources=lambda: None,
        driver=Driver(free_memory=driver_free_memory(gpu, processes)),
    )
    agent.usage.check()  # the limits files, before any process starts
    stop = threading.Event()
    checks = threading.Thread(target=agent.usage.run, args=(stop,))
    checks.start()
    try:
        rng = random.Random(16)
        env = gpu.env()
        env.pop("TESSERA_REGION")
        for where in borrowers:
            argv = [str(clients.dynamic), "dlsym", *best_effort_load(rng, 300)]
            kube.processes[where.root.parent.name] = [processes.start(in_container(where, argv), env)]
        # The borrowers take what the standard container leaves before it starts.
        wait_for(
            lambda: used_mib(agent) >= GPU_MIB - 2 * BLOCK_MIB,
            timeout=60,
            what="the best-effort containers to fill the GPU",
        )
        walk = processes.run(
            in_container(standard, [str(clients.dynamic), "dlsym", *guaranteed_walk(rng, 120)]),
            env,
            timeout=600,
        )
    finally:
        stop.set()
        checks.join()
    answers = walk.lines
    assert answers and all(a == "ok" or a.startswith("ok ") for a in answers), walk.stderr
    # Its growth was served by evicting borrowers, newest first, each with an event saying why.
    assert kube.deleted and kube.deleted == sorted(kube.deleted, reverse=True)
    assert agent.usage.evictions == len(kube.deleted)
    assert all(reason == EVICTED_REASON and f"GPU {gpu.uuids[0]}" in msg for _, reason, msg in kube.events)
    assert [name for name, _, _ in kube.events] == kube.deleted
    # The best-effort containers were refused by their dynamic quota before anyone was evicted.
    assert any(
        (u := where.usage()) is not None
        and (d := u.device(gpu.uuids[0])) is not None
        and d.allocations_refused
        for where in borrowers
    )
    # The measured use was published with the heartbeat path.
    agent.publisher.publish(heartbeat=True)
    assert parse_gpu_usage(kube.node[config.keys.node_gpu_usage]).gpus[0].uuid == gpu.uuids[0]
