"""The DRA path on a real node: the sandbox with Kubernetes 1.37's kubelet and the containerd 2 that
hack/k8s-binaries.sh builds (CDI on), Tessera installed by its chart in DRA mode. kube-scheduler
allocates the claims, the kubelet has ``tessera-dra`` prepare them and containerd applies the claim's
CDI device; inside each container the hook, over the fake driver, holds the claim's share and its
QoS class."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.stream import stream
from kubernetes.utils import parse_quantity
from prometheus_client.parser import text_string_to_metric_families

import fakegpu
from draplugin.claims import OVERCOMMITTED
from draplugin.health import GPU_UNHEALTHY_REASON
from sandbox import cluster as sandbox_cluster
from sandbox import gpu, install
from sandbox.controlplane import DRA_K8S_VERSION
from sandbox.layout import Layout
from simulator.kubedra import allocate
from tessera.contract import (
    CONTAINER_COORDINATION_DIR,
    CONTAINER_LIMITS_FILE,
    COORDINATION_SLOT_BYTES,
    COORDINATION_SLOT_SUFFIX,
    KEYS,
    MIB,
)
from tessera.placement import ContainerShape, GpuState, NodeState, PodShape, apply
from tessera.placement.qos import QOS_LOWERED_REASON
from tests.draplugin.conftest import Cluster, namespace_view
from tests.hook.test_qos import (
    BEST_EFFORT_KERNEL,
    CRITICAL_KERNEL,
    CRITICAL_PERIOD_US,
    NOISE_US,
    SLICE_US,
    Paced,
)
from tests.sandbox.conftest import Sandbox, running_sandbox
from tests.waiting import wait_for

pytestmark = pytest.mark.sandbox

GIB = 2**30
A100, T4 = gpu.SANDBOX_GPUS
A100_ONLY = 'device.attributes["tessera.io"].model == "A100"'
T4_ONLY = 'device.attributes["tessera.io"].model == "T4"'
CUDA_ERROR_OUT_OF_MEMORY = "2"
EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "dra-shared-gpu.yaml"


def probe_container() -> dict[str, Any]:
    """The example's container: vgpu-probe reports the memory the driver claims and allocates 256 MiB
    blocks until refused, then idles (``kubectl exec ... vgpu-probe`` runs it again)."""
    _, pod = yaml.safe_load_all(EXAMPLE.read_text())
    container: dict[str, Any] = {k: v for k, v in pod["spec"]["containers"][0].items() if k != "resources"}
    return container


@pytest.fixture(scope="module")
def node(request: pytest.FixtureRequest) -> Iterator[Sandbox]:
    with running_sandbox("dra", request.session, mode="dra") as (sandbox, _):
        yield sandbox


@contextlib.contextmanager
def probe_view(sandbox: Sandbox) -> Iterator[Cluster]:
    """A namespace of the sandbox for probe pods, ready for them."""
    with namespace_view(sandbox.api, probe_container()) as view:
        # The ServiceAccount admission refuses pods until the namespace has its default account.
        wait_for(
            lambda: view.core.list_namespaced_service_account(view.namespace).items,
            60.0,
            f"the default service account of {view.namespace}",
        )
        yield view


@pytest.fixture
def cluster(node: Sandbox) -> Iterator[Cluster]:
    with probe_view(node) as view:
        yield view


def probe_report(cluster: Cluster, pod: str, timeout: float = 120.0) -> dict[str, str]:
    """The probe's report ("key=value" lines) from the pod's log, once it is Running and refused."""
    wait_for(
        lambda: cluster.core.read_namespaced_pod(pod, cluster.namespace).status.phase == "Running",
        timeout,
        f"pod {pod} Running",
    )

    def report() -> dict[str, str] | None:
        text: str = cluster.core.read_namespaced_pod_log(pod, cluster.namespace)
        return (
            dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
            if "refused_with=" in text
            else None
        )

    found: dict[str, str] = wait_for(report, 60.0, f"the probe's report in pod {pod}")
    return found


def exec_in(cluster: Cluster, pod: str, *command: str) -> str:
    """`kubectl exec POD -- COMMAND...`: its output, stdout and stderr together."""
    out: str = stream(
        cluster.core.connect_get_namespaced_pod_exec,
        pod,
        cluster.namespace,
        command=list(command),
        stderr=True,
        stdin=False,
        stdout=True,
        tty=False,
    )
    return out


def exec_probe(cluster: Cluster, pod: str) -> dict[str, str]:
    """`kubectl exec POD -- vgpu-probe 256`: a new process in the running container."""
    out = exec_in(cluster, pod, "vgpu-probe", "256")
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def claim_files(node: Sandbox, name: str | None = None) -> list[str]:
    """Every file the driver wrote on the host for claims: their dirs, their coordination slots and
    their CDI specs; on the first node, or on further node ``name``, where the host keeps them."""
    layout = Layout(node.root) if name in (None, node.state.node) else Layout(node.root).of_node(str(name))
    state = layout.place(install.host_dirs(layout).state)
    roots = (state / "claims", state / "coordination", layout.place(layout.cdi_dir))
    return sorted(str(p) for root in roots if root.exists() for p in root.rglob("*") if p.is_file())


def files_of(node: Sandbox, claim_uid: str, name: str | None = None) -> list[str]:
    return [f for f in claim_files(node, name) if claim_uid in f]


def driver_written(node: Sandbox, claim_uid: str, name: str | None = None) -> dict[str, bytes]:
    """The claim's files the driver wrote (limits, CDI spec, record), not the hook's accounting
    region beside them, which changes as the claim's processes use the GPU; on the first node, or
    on further node ``name``."""
    return {
        f: Path(f).read_bytes() for f in files_of(node, claim_uid, name) if f"/{claim_uid}/state/" not in f
    }


def events(cluster: Cluster, pod: str, reason: str) -> list[str]:
    return [e.message for e in cluster.events(pod, reason)]


def test_two_claims_share_the_a100_each_held_to_its_own_share(node: Sandbox, cluster: Cluster) -> None:
    cluster.create_claim("small", {"memory": "1Gi", "cores": "30"}, A100_ONLY)
    cluster.create_claim("large", {"memory": "3Gi", "cores": "50"}, A100_ONLY)
    cluster.create_pod("small", "small")
    cluster.create_pod("large", "large")
    small, large = cluster.allocated("small"), cluster.allocated("large")
    assert (small["device"], large["device"]) == ("gpu-0", "gpu-0")
    assert small["consumedCapacity"] == {"memory": str(GIB), "cores": "30"}
    assert large["consumedCapacity"] == {"memory": str(3 * GIB), "cores": "50"}

    # Inside each container, through the hook over the fake driver: the claim's memory is the GPU's.
    small_report, large_report = probe_report(cluster, "small"), probe_report(cluster, "large")
    assert (small_report["device"], small_report["total_mib"]) == (A100.model, "1024")
    assert (small_report["allocations_ok"], small_report["refused_with"]) == ("4", CUDA_ERROR_OUT_OF_MEMORY)
    assert (large_report["device"], large_report["total_mib"]) == (A100.model, "3072")
    assert (large_report["allocations_ok"], large_report["refused_with"]) == ("12", CUDA_ERROR_OUT_OF_MEMORY)
    # The compute shares go to the hook as its own tests exercise them (tests/hook/test_compute.py).
    state = install.host_dirs(Layout(node.root)).state / "claims"
    for name, line in (
        ("small", f"device {A100.uuid} memory {GIB} cores 30"),
        ("large", f"device {A100.uuid} memory {3 * GIB} cores 50"),
    ):
        uid = cluster.claim(name)["metadata"]["uid"]
        assert line in (state / uid / "limits.d" / "limits").read_text().splitlines()


def test_a_pod_asking_a_whole_gpu_runs_with_the_whole_gpu(node: Sandbox, cluster: Cluster) -> None:
    """KEP-5004 on a real kubelet: a pod with tessera.io/whole-gpu: 1 in its limits and no claim.
    kube-scheduler makes and allocates its claim (all the A100's memory, cores 0), the kubelet admits
    the pod although the node advertises no such resource, has the driver prepare the claim and gives
    the container its CDI device by the pod's request mapping; inside, the hook holds the whole A100.
    The pod goes: the kubelet has the driver unprepare the claim, the garbage collector deletes it."""
    cluster.create_plain_pod("whole", {KEYS.whole_gpu: "1"}, scheduler="default-scheduler")
    claim = wait_for(
        lambda: (
            cluster.core.read_namespaced_pod("whole", cluster.namespace).status.extended_resource_claim_status
        ),
        90.0,
        "the pod's extendedResourceClaimStatus",
    ).resource_claim_name
    result = cluster.allocated(claim)
    assert result["device"] == "gpu-0"
    assert result["consumedCapacity"] == {"memory": str(40 * GIB), "cores": "0"}
    report = probe_report(cluster, "whole")
    assert (report["device"], report["total_mib"]) == (A100.model, str(A100.total_memory_mib))
    assert report["refused_with"] == CUDA_ERROR_OUT_OF_MEMORY
    limits = exec_in(cluster, "whole", "cat", CONTAINER_LIMITS_FILE).splitlines()
    assert f"device {A100.uuid} memory {40 * GIB} cores 0" in limits, limits
    uid = cluster.claim(claim)["metadata"]["uid"]
    assert files_of(node, uid)
    cluster.delete_pod("whole", grace_seconds=None)
    wait_for(lambda: not files_of(node, uid), 90.0, "the whole GPU's claim unprepared")

    def claim_gone() -> bool:
        names = cluster.objects.list_namespaced_custom_object(
            "resource.k8s.io", "v1", cluster.namespace, "resourceclaims"
        )["items"]
        return claim not in [c["metadata"]["name"] for c in names]

    wait_for(claim_gone, 90.0, "the pod's claim deleted")


def share_config(qos: str) -> dict[str, str]:
    return {"apiVersion": KEYS.dra_config_api_version, "kind": "GpuShareConfig", "qos": qos}


@pytest.fixture
def high_priority(node: Sandbox) -> Iterator[str]:
    """A PriorityClass of 1,000,000, which grants latency-critical (the chart's extender.qos)."""
    scheduling = client.SchedulingV1Api(node.api)
    name = "tessera-dra-high"
    scheduling.create_priority_class({"metadata": {"name": name}, "value": 1_000_000})
    try:
        yield name
    finally:
        scheduling.delete_priority_class(name)


def test_a_latency_critical_and_a_best_effort_claim_on_one_gpu_are_classed_as_pods_are(
    node: Sandbox, cluster: Cluster, high_priority: str
) -> None:
    """The device plugin path's classes through claims: each container's limits file carries the
    class the pods' rule gives its claim and the coordination line; both containers see the A100's
    coordination area, one slot per claim under its class (what one claim's slot says the other
    reads), read-only but for their own slot. A claim asking for more than its pod's priority grants
    runs with the granted class and its pod gets a QosClassLowered event, as a pod asking by
    annotation does (tests/sandbox/test_escapes.py). The yield itself: the next test."""
    cluster.create_claim(
        "critical", {"memory": "2Gi", "cores": "40"}, A100_ONLY, share_config("latency-critical")
    )
    cluster.create_claim("batch", {"memory": "2Gi"}, A100_ONLY, share_config("best-effort"))
    cluster.create_claim("greedy", {"memory": "1Gi"}, A100_ONLY, share_config("latency-critical"))
    cluster.create_pod("critical", "critical", priority_class=high_priority)
    cluster.create_pod("batch", "batch")
    cluster.create_pod("greedy", "greedy")  # priority 0: standard at most
    for name in ("critical", "batch", "greedy"):
        assert cluster.allocated(name)["device"] == "gpu-0"
        probe_report(cluster, name)  # Running, and the hook holds its share
    uids = {name: cluster.claim(name)["metadata"]["uid"] for name in ("critical", "batch", "greedy")}

    classes = {"critical": "latency-critical", "batch": "best-effort", "greedy": "standard"}
    for name, qos in classes.items():
        limits = exec_in(cluster, name, "cat", CONTAINER_LIMITS_FILE).splitlines()
        assert f"qos {qos}" in limits, limits
        assert f"coordination {CONTAINER_COORDINATION_DIR}" in limits, limits

    area = f"{CONTAINER_COORDINATION_DIR}/{A100.uuid}"
    for name, own in classes.items():
        # Each container sees every claim's slot on the GPU, by class.
        for peer, qos in classes.items():
            assert uids[peer] in exec_in(cluster, name, "ls", f"{area}/{qos}").split(), (name, peer)
        # Its own slot, zeroed (no kernel launched), is the one under its class.
        slot = f"{area}{COORDINATION_SLOT_SUFFIX}"
        assert exec_in(cluster, name, "ls", "-l", slot).split()[4] == str(COORDINATION_SLOT_BYTES)
        # The area is read-only: no container moves or forges a slot.
        refused = exec_in(cluster, name, "sh", "-c", f"echo x > {area}/{own}/forged || echo refused")
        assert "refused" in refused, refused

    # What the latency-critical claim writes in its own slot, the best-effort one reads under
    # latency-critical: the hook's yield reads exactly that.
    exec_in(cluster, "critical", "sh", "-c", f"echo busy > {area}{COORDINATION_SLOT_SUFFIX}")
    seen = exec_in(cluster, "batch", "cat", f"{area}/latency-critical/{uids['critical']}")
    assert seen.strip() == "busy", seen

    lowered = wait_for(
        lambda: events(cluster, "greedy", QOS_LOWERED_REASON), 60.0, "the QosClassLowered event"
    )
    assert "asked for QoS class latency-critical, runs as standard" in lowered[0], lowered
    assert not events(cluster, "critical", QOS_LOWERED_REASON)

    # The pod goes: its claim's slot goes with the claim's other files.
    cluster.delete_pod("batch", grace_seconds=None)
    wait_for(lambda: not files_of(node, uids["batch"]), 90.0, "claim batch unprepared with its slot")
    assert uids["batch"] not in exec_in(cluster, "critical", "ls", f"{area}/best-effort").split()


def paced(cluster: Cluster, pod: str, seconds: float) -> Paced:
    """`vgpu-probe paced`: the latency-critical client of tests/hook/test_qos.py, in the pod."""
    command = ["vgpu-probe", "paced", CRITICAL_KERNEL, str(CRITICAL_PERIOD_US), str(seconds)]
    out = exec_in(cluster, pod, *command)
    line = next((line for line in out.splitlines() if line.startswith("paced=")), None)
    assert line is not None, out
    count, p50, p99, most, took = line.removeprefix("paced=").split()
    return Paced(int(count), float(p50), float(p99), float(most), float(took))


def test_a_latency_critical_claim_keeps_its_latency_beside_a_best_effort_one(
    cluster: Cluster, high_priority: str
) -> None:
    """The fake GPU's QoS check (tests/hook/test_qos.py) through claims: the latency-critical claim's
    1 ms kernels, paced at 30% of the GPU, wait at most about one time slice longer beside a
    best-effort claim launching 5 ms kernels flat out than alone (without the classes they wait for
    the best-effort kernels: p99 about 7 ms instead of 2.3 ms on the fake GPU), and the best-effort
    claim still runs."""
    cluster.create_claim(
        "critical", {"memory": "1Gi", "cores": "40"}, A100_ONLY, share_config("latency-critical")
    )
    cluster.create_claim("batch", {"memory": "1Gi"}, A100_ONLY, share_config("best-effort"))
    cluster.create_pod("critical", "critical", priority_class=high_priority)
    cluster.create_pod("batch", "batch")
    probe_report(cluster, "critical")
    probe_report(cluster, "batch")

    alone = paced(cluster, "critical", 4)
    # The best-effort client in its own exec, on its own client: the Kubernetes client's exec swaps
    # its ApiClient's request method while a call is under way.
    launched: dict[str, str] = {}
    batch_api = Cluster(client.ApiClient(cluster.api.configuration), cluster.namespace)
    flat_out = threading.Thread(
        target=lambda: launched.setdefault(
            "out", exec_in(batch_api, "batch", "vgpu-probe", "launch", BEST_EFFORT_KERNEL, "7")
        )
    )
    flat_out.start()
    try:
        beside = paced(cluster, "critical", 6)
    finally:
        flat_out.join(60)
        batch_api.api.close()
    numbers = f"alone {alone}, beside best-effort {beside}; best-effort: {launched.get('out')!r}"
    assert beside.p99_us <= alone.p99_us + SLICE_US + NOISE_US, numbers
    assert int(launched["out"].split("launched=")[1].split()[0]) > 0, numbers


def test_a_claim_no_gpu_fits_stays_pending_with_the_schedulers_reason(cluster: Cluster) -> None:
    cluster.create_claim("huge", {"memory": "48Gi"})
    cluster.create_pod("huge", "huge")
    assert "cannot allocate all claims" in cluster.unschedulable("huge")
    assert not (cluster.claim("huge").get("status") or {}).get("allocation")


def test_a_cel_model_selector_lands_only_on_that_model(cluster: Cluster) -> None:
    cluster.create_claim("t4", {"memory": "2Gi"}, T4_ONLY)
    cluster.create_pod("t4", "t4")
    assert cluster.allocated("t4")["device"] == "gpu-1"
    report = probe_report(cluster, "t4")
    assert (report["device"], report["total_mib"]) == (T4.model, "2048")


def test_three_15g_claims_on_the_40g_gpu_two_fit_and_deleting_a_pod_frees_its_share(
    node: Sandbox, cluster: Cluster
) -> None:
    for n in (1, 2):
        cluster.create_claim(f"c{n}", {"memory": "15Gi"}, A100_ONLY)
        cluster.create_pod(f"p{n}", f"c{n}")
        assert cluster.allocated(f"c{n}")["device"] == "gpu-0"
    cluster.create_claim("c3", {"memory": "15Gi"}, A100_ONLY)
    cluster.create_pod("p3", "c3")
    assert "cannot allocate all claims" in cluster.unschedulable("p3")
    assert probe_report(cluster, "p1")["total_mib"] == "15360"
    first = cluster.claim("c1")["metadata"]["uid"]
    assert files_of(node, first)

    # The pod goes: the kubelet has the driver unprepare its claim; the claim's share is free again.
    cluster.delete_pod("p1", grace_seconds=None)
    wait_for(lambda: not files_of(node, first), 90.0, "claim c1 unprepared on the node")
    cluster.objects.delete_namespaced_custom_object(
        "resource.k8s.io", "v1", cluster.namespace, "resourceclaims", "c1"
    )
    assert cluster.allocated("c3", timeout=120)["device"] == "gpu-0"
    assert probe_report(cluster, "p3")["total_mib"] == "15360"


def test_a_claim_allocated_past_its_gpus_capacity_waits_on_the_node_until_it_fits(
    node: Sandbox, cluster: Cluster
) -> None:
    """kube-scheduler's lost bind (docs/dra.md, "Allocated past a device's capacity") met by the real
    kubelet: a second claim allocated on the A100 beside a running 30 GiB one, 50 of its 40 GiB in
    all, reserved for a pod bound to the node. The kubelet reports the driver's reason on the pod and
    retries; once the first pod is gone and its claim unprepared, the second runs with its share."""
    cluster.create_claim("first", {"memory": "30Gi"}, A100_ONLY)
    cluster.create_pod("first", "first")
    assert cluster.allocated("first")["device"] == "gpu-0"
    assert probe_report(cluster, "first")["total_mib"] == str(30 * 1024)
    cluster.create_claim("second", {"memory": "20Gi"}, A100_ONLY)
    cluster.allocate_as_lost_bind("second", "first", node.state.node, memory_bytes=20 * GIB)
    [held, *_] = wait_for(
        lambda: [m for m in events(cluster, "second", "FailedPrepareDynamicResources") if OVERCOMMITTED in m],
        90.0,
        "the kubelet's event with the driver's reason",
    )
    assert "gpu-0 (" in held and "51200 MiB of its 40960" in held, held
    assert f"beside those prepared on it ({cluster.namespace}/first)" in held, held
    assert cluster.core.read_namespaced_pod("second", cluster.namespace).status.phase == "Pending"
    assert files_of(node, cluster.claim("second")["metadata"]["uid"]) == []

    cluster.delete_pod("first", grace_seconds=None)
    assert probe_report(cluster, "second", timeout=180)["total_mib"] == str(20 * 1024)


# (memory, cores) of each claim in turn: they fill the A100, spill to the T4, come back to the A100's
# last 4 GiB, and end with one that fits nowhere by memory and one that fits nowhere by cores.
SHARES = (("20Gi", 30), ("16Gi", 20), ("8Gi", 60), ("4Gi", 10), ("12Gi", 10), ("2Gi", 30), ("1Gi", 20))


def test_claims_land_on_the_devices_the_simulators_model_of_kube_scheduler_chooses(
    node: Sandbox, cluster: Cluster
) -> None:
    """The real 1.37 allocator and the simulator's model of it (``simulator.kubedra.allocate``: the
    first device in slice order whose capacity left fits) place a sequence of claims alike: the same
    device for each, and no device where the model finds none."""
    state = NodeState(
        node.state.node,
        tuple(
            GpuState(g.uuid, i, g.model, g.total_memory_mib, slices=10)
            for i, g in enumerate(gpu.SANDBOX_GPUS)
        ),
    )
    for n, (memory, cores) in enumerate(SHARES):
        name = f"share-{n}"
        shape = PodShape((ContainerShape(1, int(parse_quantity(memory)) // MIB, cores),))
        placement = allocate(state, shape)
        cluster.create_claim(name, {"memory": memory, "cores": str(cores)})
        cluster.create_pod(name, name)
        if placement is None:
            assert "cannot allocate all claims" in cluster.unschedulable(name), (name, memory, cores)
            continue
        ((grant,),) = placement.containers
        assert cluster.allocated(name)["device"] == f"gpu-{grant.gpu}", (name, memory, cores)
        state = apply(state, placement)
    assert [g.free_memory_mib for g in state.gpus] == [0, 5120]  # the sequence did what it says


def _driver_away(node: Sandbox, away: bool) -> None:
    """Keep the chart's DaemonSet off every node (``away``) or let it back, as an operator would."""
    selector = {"tessera.io/no-such-node": "true"} if away else None
    client.AppsV1Api(node.api).patch_namespaced_daemon_set(
        "tessera-dra", install.NAMESPACE, {"spec": {"template": {"spec": {"nodeSelector": selector}}}}
    )


def test_driver_restarts_before_and_after_prepare_lose_nothing(node: Sandbox, cluster: Cluster) -> None:
    # Between allocation and prepare: the driver's pod is gone when the claim is allocated; the
    # kubelet retries the prepare until a new driver answers.
    try:
        _driver_away(node, True)
        wait_for(lambda: not install.agent_pods(node.api, node.state.node), 90.0, "the driver's pod gone")
        cluster.create_claim("share", {"memory": "1Gi", "cores": "30"}, A100_ONLY)
        cluster.create_pod("share", "share")
        assert cluster.allocated("share")["device"] == "gpu-0"
        uid = cluster.claim("share")["metadata"]["uid"]
        wait_for(lambda: events(cluster, "share", "FailedPrepareDynamicResources"), 90.0, "a failed prepare")
        assert cluster.core.read_namespaced_pod("share", cluster.namespace).status.phase == "Pending"
        assert not files_of(node, uid)
    finally:
        _driver_away(node, False)
    report = probe_report(cluster, "share", timeout=180.0)
    assert (report["total_mib"], report["allocations_ok"]) == ("1024", "4")

    # After prepare: a new driver pod; the running container keeps its quota, a new pod gets its
    # own, and the new driver unprepares what the old one prepared.
    written = driver_written(node, uid)
    sandbox_cluster.replace_agent(node.root)
    again = exec_probe(cluster, "share")
    assert (again["total_mib"], again["allocations_ok"]) == ("1024", "4")
    assert driver_written(node, uid) == written
    cluster.create_claim("later", {"memory": "2Gi"}, A100_ONLY)
    cluster.create_pod("later", "later")
    assert probe_report(cluster, "later")["total_mib"] == "2048"
    cluster.delete_pod("share", grace_seconds=None)
    wait_for(lambda: not files_of(node, uid), 90.0, "claim share unprepared by the new driver")


def test_an_xid_taints_the_gpu_within_5s_its_pod_is_told_and_evicted_and_a_new_claim_runs_elsewhere(
    node: Sandbox, cluster: Cluster
) -> None:
    """The issue's health check on the real node: XID 79 on the A100 that a running claim's pod uses;
    its device is tainted NoExecute within 5 s, the pod gets TesseraGpuUnhealthy and is deleted by
    the device taint eviction controller, a new claim (first fit: the A100) runs on the T4. Lost and
    back, the A100 is healthy again for the tests after this one."""
    state = gpu.files_for(Layout(node.root)).state
    name = f"{node.state.node}-{KEYS.dra_driver}"

    def taints() -> list[list[dict[str, Any]]]:
        found = cluster.objects.get_cluster_custom_object("resource.k8s.io", "v1", "resourceslices", name)
        return [d.get("taints", []) for d in found["spec"]["devices"]]

    cluster.create_claim("victim", {"memory": "1Gi"}, A100_ONLY)
    cluster.create_pod("victim", "victim")
    probe_report(cluster, "victim")
    try:
        fakegpu.inject_xid(state, A100.uuid, 79)
        wait_for(lambda: taints()[0], 5.0, "the A100's device tainted")
        [taint] = taints()[0]
        assert (taint["key"], taint["value"], taint["effect"]) == (
            KEYS.dra_unhealthy_taint,
            "xid-79",
            "NoExecute",
        )
        [message] = wait_for(lambda: events(cluster, "victim", GPU_UNHEALTHY_REASON), 30.0, "the event")
        assert f"GPU {A100.uuid} (device gpu-0) is unhealthy: critical XID 79" in message

        def evicted() -> bool:
            try:
                pod = cluster.core.read_namespaced_pod("victim", cluster.namespace)
            except client.ApiException as e:
                return e.status == 404
            conditions = {(c.type, c.reason) for c in pod.status.conditions or []}
            return ("DisruptionTarget", "DeletionByDeviceTaintManager") in conditions

        wait_for(evicted, 60.0, "the victim evicted by the device taint eviction controller")
        cluster.create_claim("newcomer", {"memory": "1Gi"})
        cluster.create_pod("newcomer", "newcomer")
        assert cluster.allocated("newcomer")["device"] == "gpu-1"
        assert probe_report(cluster, "newcomer")["total_mib"] == "1024"
    finally:
        fakegpu.set_lost(state, A100.uuid, True)
        wait_for(lambda: [t["value"] for t in taints()[0]] == ["gone"], 30.0, "the A100 seen gone")
        fakegpu.set_lost(state, A100.uuid, False)
    wait_for(lambda: taints() == [[], []], 30.0, "the A100 healthy again")


def test_bad_claims_are_refused_clearly_with_nothing_written(node: Sandbox, cluster: Cluster) -> None:
    # More than the request policy allows: no device can take it.
    cluster.create_claim("greedy", {"cores": "150"}, A100_ONLY)
    cluster.create_pod("greedy", "greedy")
    assert "cannot allocate all claims" in cluster.unschedulable("greedy")

    # Opaque parameters that are no JSON object: refused at creation, naming the field.
    with pytest.raises(client.ApiException, match=r"opaque\.parameters"):
        cluster.create_claim("unparsable", {"memory": "1Gi"}, A100_ONLY, "not an object")

    # An attribute no device has: the selector cannot be evaluated (kube-scheduler retries it).
    cluster.create_claim("colour", {"memory": "1Gi"}, 'device.attributes["tessera.io"].colour == "red"')
    cluster.create_pod("colour", "colour")
    reason, message = cluster.not_scheduled("colour")
    assert reason == "SchedulerError"
    assert "CEL runtime error: no such key: colour" in message

    # A malformed opaque config: allocated (the API server checks only that it is JSON), refused by
    # the driver's prepare with the field named; the kubelet reports it on the pod, which does not
    # start; nothing is written on the node.
    cluster.create_claim(
        "configured",
        {"memory": "1Gi"},
        A100_ONLY,
        {"apiVersion": KEYS.dra_config_api_version, "kind": "GpuShareConfig", "elastic": "yes"},
    )
    cluster.create_pod("configured", "configured")
    cluster.allocated("configured")
    uid = cluster.claim("configured")["metadata"]["uid"]
    expected = (
        f"claim {cluster.namespace}/configured ({uid}): status.allocation.devices.config[0].opaque.parameters: "
        'elastic: Input should be a valid boolean (got "yes")'
    )
    refused = wait_for(
        lambda: [m for m in events(cluster, "configured", "FailedPrepareDynamicResources") if expected in m],
        90.0,
        "the driver's refusal on the pod",
    )
    assert refused
    assert cluster.core.read_namespaced_pod("configured", cluster.namespace).status.phase == "Pending"
    assert not files_of(node, uid)


def test_the_example_claim_template_runs_with_its_share(cluster: Cluster) -> None:
    """deploy/examples/dra-shared-gpu.yaml as a user applies it."""
    template, pod = yaml.safe_load_all(EXAMPLE.read_text())
    cluster.objects.create_namespaced_custom_object(
        "resource.k8s.io", "v1", cluster.namespace, "resourceclaimtemplates", template
    )
    cluster.core.create_namespaced_pod(cluster.namespace, pod)
    report = probe_report(cluster, pod["metadata"]["name"])
    assert (report["device"], report["total_mib"], report["allocations_ok"]) == (A100.model, "4096", "16")


def test_a_running_claims_container_shows_its_memory_used_in_the_drivers_metrics(
    node: Sandbox, cluster: Cluster
) -> None:
    """The probe holds the 1 GiB of its pod's own claim (from a template: 4 blocks of 256 MiB, then
    refused) while the sandbox's scraper reads the DRA driver's /metrics on its pod: the claim's
    series, labelled with its pod, container and name, show the quota and the memory its container
    holds, as the hook accounts it."""
    cluster.container["command"] = ["vgpu-probe", "256", "600"]
    cluster.create_claim_template("held", {"memory": "1Gi", "cores": "30"}, A100_ONLY)
    cluster.create_pod("holder", "held", template=True)
    assert probe_report(cluster, "holder")["allocations_ok"] == "4"
    labels = {
        "namespace": cluster.namespace,
        "pod": "holder",
        "container": cluster.container["name"],
        "claim": cluster.claim_of("holder"),
        "Hostname": node.state.node,
        "UUID": A100.uuid,
        "modelName": A100.model,
    }

    def series() -> dict[str, float]:
        text = install.agent_metrics(node.api, node.state.node)
        return {
            sample.name: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.labels == labels
        }

    found = series()
    assert found["tessera_container_memory_quota_bytes"] == GIB
    assert found["tessera_container_compute_quota_ratio"] == 0.3
    assert found["tessera_container_memory_used_bytes"] == GIB
    assert found["tessera_container_allocations_refused_total"] == 1


def test_the_node_runs_the_newest_kubernetes_on_containerd_2(node: Sandbox) -> None:
    info = node.core.read_node(node.state.node).status.node_info
    assert info.kubelet_version == DRA_K8S_VERSION
    assert info.container_runtime_version.startswith("containerd://2.")
