"""Three real nodes (`tessera sandbox up --nodes 3`, sandbox.nodes): each a kubelet with its own
containerd, kube-proxy, fake GPUs and node agent, joined to one control plane. What must hold when
nodes come and go: pods reach each other and the cluster's Services across nodes; a node that dies
with GPU pods on it has them recreated elsewhere with their quotas, its shares counted until
Kubernetes has deleted its pods and its leftovers cleaned when it returns; a drained node's GPU pods
move with their quotas; a node cut off from the control plane keeps enforcing its pods' quotas.

The node agent and the scheduler run as the chart installs them on any cluster: a DaemonSet on every
node, two tessera-scheduler replicas (with the extender) on different nodes."""

from __future__ import annotations

import contextlib
import copy
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from kubernetes import client

from nodeagent.statedir import StateDir
from sandbox import cluster, containerd, install, kubeapi, nodelife
from sandbox.layout import Layout
from tessera.contract import KEYS, MIB, parse_allocation, parse_inventory
from tests.sandbox.conftest import FLEET_NODES, LAST, HostView, Sandbox, differences
from tests.sandbox.test_chaos import Invariants, Watcher, describe, limits_lines, mounted_limits
from tests.sandbox.test_chart_lifecycle import SCHEDULER, helm, leader_pod, probe_pod, rolled_out
from tests.waiting import wait_for

pytestmark = pytest.mark.sandbox


# How long a Deployment's pods stay on a node that stopped answering (the default is 300 s).
TOLERATION_SECONDS = 30
# Kubernetes's own timings: node-monitor-grace-period (50 s) plus the toleration, plus the
# controller's and the kubelet's sync periods; generous for a loaded 2-core host.
EVICTION_TIMEOUT = 240.0


# After the chaos test's, which runs on the same nodes (tests/sandbox/conftest.py `fleet`): the last
# test here brings the fleet down.
FLEET_TURN = LAST


@pytest.fixture
def sbx(fleet: Sandbox) -> Sandbox:
    return fleet


def _on_node(pod: dict[str, Any], nodes: list[str]) -> dict[str, Any]:
    pod["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {"key": "kubernetes.io/hostname", "operator": "In", "values": nodes}
                        ]
                    }
                ]
            }
        }
    }
    return pod


def _node_of(sbx: Sandbox, pod: str) -> str:
    return str(sbx.core.read_namespaced_pod(pod, "default").spec.node_name)


def _ready(sbx: Sandbox, node: str) -> bool:
    status = sbx.core.read_node_status(node).status
    return any(c.type == "Ready" and c.status == "True" for c in status.conditions or [])


def _check_limits(sbx: Sandbox, pod: Any) -> None:
    """The container sees exactly its allocation (the limits file the node agent mounted)."""
    allocation = parse_allocation(pod.metadata.annotations[KEYS.allocation])
    for container in allocation.containers:
        limits = mounted_limits(sbx.core, pod.metadata.name, container.name)
        assert limits_lines(limits) == {
            f"device {g.uuid} memory {g.memory_quota_mib * MIB} cores {g.cores}" for g in container.gpus
        }, f"pod {pod.metadata.name} on {pod.spec.node_name}: {limits} against {allocation}"


@contextlib.contextmanager
def _watched(sbx: Sandbox) -> Iterator[Invariants]:
    """No GPU overcommitted at any moment, by every pod Kubernetes still has (checked every 2 s)."""
    with watching(Invariants(sbx, sbx.state_dirs(), sbx.gpu_capacity())) as invariants:
        yield invariants


W = TypeVar("W", bound=Watcher)


@contextlib.contextmanager
def watching(watcher: W) -> Iterator[W]:
    """The watcher's thread runs while the block does; then nothing it checked may have failed."""
    stop = threading.Event()
    checker = threading.Thread(target=watcher.watch, args=(stop,), daemon=True)
    checker.start()
    try:
        yield watcher
    finally:
        stop.set()
        checker.join()
        watcher.api.close()
    assert not watcher.violations, watcher.violations
    assert watcher.checks > 0


def _deployment(name: str, replicas: int, nodes: list[str], memory_mib: int, cores: int) -> dict[str, Any]:
    return deployment_of(name, replicas, _on_node(probe_pod(name, memory_mib, cores, idle=True), nodes))


def deployment_of(name: str, replicas: int, pod: dict[str, Any]) -> dict[str, Any]:
    """A Deployment of ``replicas`` such pods (labelled ``app=NAME``), restarted always and tolerating
    a not-ready or unreachable node for TOLERATION_SECONDS."""
    spec = copy.deepcopy(pod["spec"])
    spec["restartPolicy"] = "Always"
    spec["tolerations"] = [
        {"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": TOLERATION_SECONDS}
        for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
    ]
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels, "annotations": pod["metadata"].get("annotations", {})},
                "spec": spec,
            },
        },
    }


def _pods_of(sbx: Sandbox, app: str) -> list[Any]:
    return list(sbx.core.list_namespaced_pod("default", label_selector=f"app={app}").items)


def run_deployment(sbx: Sandbox, deployment: dict[str, Any]) -> list[Any]:
    """The Deployment created in ``default``; its pods once all of its replicas are Running."""
    client.AppsV1Api(sbx.api).create_namespaced_deployment("default", deployment)
    app, replicas = deployment["metadata"]["name"], deployment["spec"]["replicas"]
    wait_for(
        lambda: len(_running(_pods_of(sbx, app))) == replicas, timeout=180, what=f"{replicas} pods running"
    )
    return _running(_pods_of(sbx, app))


def _running(pods: list[Any]) -> list[Any]:
    return [p for p in pods if p.status.phase == "Running" and not p.metadata.deletion_timestamp]


def test_three_nodes_each_run_gpu_pods_and_reach_each_other(sbx: Sandbox) -> None:
    nodes = [sbx.state.node, *(n.name for n in sbx.state.nodes)]
    assert len(nodes) == FLEET_NODES and all(_ready(sbx, n) for n in nodes)
    models = {
        n.metadata.name: sorted(g.model for g in parse_inventory(n.metadata.annotations[KEYS.node_gpus]))
        for n in sbx.core.list_node().items
    }
    assert len({tuple(m) for m in models.values()}) == FLEET_NODES, models  # a mixed fleet
    assert {n for n, m in models.items() if any("A100" in g for g in m)} and any(
        all("T4" in g for g in m) for m in models.values()
    ), models
    agents = sbx.core.list_namespaced_pod(install.NAMESPACE, label_selector=install.AGENT_SELECTOR).items
    assert sorted(p.spec.node_name for p in agents) == sorted(nodes)
    schedulers = sbx.core.list_namespaced_pod(
        install.NAMESPACE, label_selector=install.EXTENDER_SELECTOR
    ).items
    assert len({p.spec.node_name for p in schedulers}) == 2, [p.spec.node_name for p in schedulers]

    # A GPU pod on every node, each seeing its own quota.
    for i, node in enumerate(nodes):
        kubeapi.create_pod(sbx.core, _on_node(probe_pod(f"gpu-{i}", 1024 + 512 * i, 20, idle=True), [node]))
    for i, node in enumerate(nodes):
        pod = sbx.wait_pod(f"gpu-{i}", "Running", timeout=120)
        assert pod.spec.node_name == node
        _check_limits(sbx, pod)

    # Pods on different nodes reach each other, by pod IP and by a Service's name (CoreDNS and each
    # node's kube-proxy).
    server = _on_node(probe_pod("web", 256, 5, idle=True), [nodes[2]])
    server["metadata"]["labels"] = {"app": "web"}
    server["spec"]["containers"][0]["command"] = [
        "/bin/sh", "-c", "mkdir -p /www && echo across-nodes > /www/index.html && exec httpd -f -p 8080 -h /www",
    ]  # fmt: skip
    kubeapi.create_pod(sbx.core, server)
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]},
    }
    kubeapi.retried(lambda: sbx.core.create_namespaced_service("default", service))
    try:
        ip = sbx.wait_pod("web", "Running", timeout=120).status.pod_ip
        # busybox nc (its static wget crashes on name lookups), HTTP/1.0 so the server closes. Tried
        # for up to 30 s, as a client would: a Running server may not listen yet, and each node's
        # kube-proxy writes a new Service's rules within its sync period.
        for address, port in ((ip, 8080), ("web.default.svc.cluster.local", 80)):
            client_pod = _on_node(probe_pod("fetch", 256, 5), [nodes[1]])
            fetch = (
                "i=0; while [ $i -lt 30 ]; do "
                f"out=$(printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 5 {address} {port}); "
                'case "$out" in *across-nodes*) echo "$out"; exit 0;; esac; i=$((i + 1)); sleep 1; done; exit 1'
            )
            client_pod["spec"]["containers"][0]["command"] = ["/bin/sh", "-c", fetch]
            kubeapi.create_pod(sbx.core, client_pod)
            done = sbx.wait_pod("fetch", "Succeeded", timeout=120)
            assert done.spec.node_name == nodes[1]
            assert "across-nodes" in sbx.logs("fetch", until="across-nodes")
            kubeapi.delete_pod(sbx.core, "fetch")
            wait_for(lambda: "fetch" not in {p.metadata.name for p in sbx.core.list_namespaced_pod("default").items},
                     timeout=60, what="the fetch pod gone")  # fmt: skip
    finally:
        kubeapi.delete(lambda: sbx.core.delete_namespaced_service("web", "default"))


def test_a_dead_nodes_gpu_pods_move_and_its_leftovers_go_when_it_returns(sbx: Sandbox) -> None:
    further = [n.name for n in sbx.state.nodes]
    with _watched(sbx):
        before = run_deployment(sbx, _deployment("survivor", 3, further, 1024, 20))
        counts = {n: sum(p.spec.node_name == n for p in before) for n in further}
        victim = max(counts, key=lambda n: counts[n])
        doomed = {p.metadata.uid for p in before if p.spec.node_name == victim}
        assert doomed

        nodelife.stop_node(sbx.root, victim)
        wait_for(lambda: not _ready(sbx, victim), timeout=EVICTION_TIMEOUT, what=f"{victim} NotReady")

        wait_moved(sbx, "survivor", 3, victim, timeout=EVICTION_TIMEOUT)
        for pod in _running(_pods_of(sbx, "survivor")):
            _check_limits(sbx, pod)
        # The dead node's pods are still there (Terminating: no kubelet confirms they stopped), so
        # still counted: the watcher sums them with the new ones, and nothing is overcommitted.
        left = {p.metadata.uid for p in _pods_of(sbx, "survivor") if p.spec.node_name == victim}
        assert left == doomed, (left, doomed)

        replacements = {p.metadata.uid: p for p in _running(_pods_of(sbx, "survivor"))}
        nodelife.start_node(sbx.root, victim)
        wait_for(
            lambda: not any(p.spec.node_name == victim for p in _pods_of(sbx, "survivor")),
            timeout=EVICTION_TIMEOUT,
            what=f"the old pods deleted once {victim}'s kubelet is back",
        )
        # Its agent registered again: the node offers its GPU slices.
        wait_for(
            lambda: int(sbx.core.read_node(victim).status.allocatable.get(KEYS.vgpu, "0")) > 0,
            timeout=120,
            what=f"{victim}'s slices back",
        )
        state = sbx.state_dirs()[victim]
        wait_for(
            lambda: (
                not any((state.containers / uid).exists() for uid in doomed)
                and not any(r.pod_uid in doomed for _, r in state.records())
            ),
            timeout=120,
            what=f"{victim}'s records and limits files of the deleted pods cleaned",
        )
        # Nothing of the new pods was disturbed.
        after = {p.metadata.uid: p for p in _running(_pods_of(sbx, "survivor"))}
        assert after.keys() == replacements.keys()
        for uid, pod in after.items():
            assert (
                pod.metadata.annotations[KEYS.allocation]
                == replacements[uid].metadata.annotations[KEYS.allocation]
            )
            assert all(s.restart_count == 0 for s in pod.status.container_statuses or [])


def drain(sbx: Sandbox, node: str) -> None:
    """`kubectl drain` as an operator runs it before maintenance (DaemonSets stay)."""
    kubectl = Path(sbx.state.kubernetes_bin) / "kubectl"
    done = subprocess.run(
        [str(kubectl), f"--kubeconfig={sbx.state.kubeconfig}", "drain", node,
         "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=180s"],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


def wait_moved(sbx: Sandbox, app: str, replicas: int, node: str, timeout: float = 180.0) -> None:
    """The app's pods all Running again, none on ``node``."""

    def moved() -> bool:
        pods = _running(_pods_of(sbx, app))
        return len(pods) == replicas and all(p.spec.node_name != node for p in pods)

    wait_for(moved, timeout=timeout, what=f"{app}'s pods moved off {node}")


def uncordon(sbx: Sandbox, node: str) -> None:
    """The node agent stayed through the drain (a DaemonSet pod: the last to go); uncordon brings
    the node back."""
    agents = sbx.core.list_namespaced_pod(install.NAMESPACE, label_selector=install.AGENT_SELECTOR).items
    assert node in {p.spec.node_name for p in agents}
    kubectl = Path(sbx.state.kubernetes_bin) / "kubectl"
    subprocess.run(
        [str(kubectl), f"--kubeconfig={sbx.state.kubeconfig}", "uncordon", node],
        check=True,
        capture_output=True,
    )
    assert not sbx.core.read_node(node).spec.unschedulable


def test_drain_moves_gpu_pods_with_their_quotas_and_uncordon_brings_the_node_back(sbx: Sandbox) -> None:
    further = [n.name for n in sbx.state.nodes]
    with _watched(sbx):
        victim = run_deployment(sbx, _deployment("drained", 2, further, 2048, 30))[0].spec.node_name
        drain(sbx, victim)
        wait_moved(sbx, "drained", 2, victim)
        for pod in _running(_pods_of(sbx, "drained")):
            _check_limits(sbx, pod)
        uncordon(sbx, victim)


def _log_lines(sbx: Sandbox, node: str, pod: Any, prefix: str) -> list[str]:
    """The container's log lines starting with ``prefix``, read from the node's disk, not through the
    API (which cannot reach a cut-off node)."""
    layout = Layout(sbx.root).of_node(node)
    directory = layout.place(layout.pod_logs) / f"default_{pod.metadata.name}_{pod.metadata.uid}"
    lines = []
    for log in sorted(directory.glob("*/*.log")):
        lines += [line.split(" ", 3)[-1] for line in log.read_text().splitlines()]
    return [line for line in lines if line.startswith(prefix)]


# The probe again and again: the driver reports the quota and refuses past it, every 2 s.
PROBE_LOOP = ["/bin/sh", "-c", "trap 'exit 0' TERM; while :; do vgpu-probe 256; sleep 2 & wait $!; done"]


def cut_off_and_rejoin(sbx: Sandbox, node: str, running: Any) -> Any:
    """The node cut off from the control plane under ``running``, a PROBE_LOOP pod with a 1024 MiB
    quota: the node goes NotReady while the probe goes on reporting its quota and refusing past it
    (read from the node's disk); healed, the node is Ready and the pod the same, never restarted.
    Returns the pod as it is then."""
    wait_for(
        lambda: _log_lines(sbx, node, running, "allocations_ok="), timeout=60, what="the probe's first run"
    )
    nodelife.partition_node(sbx.root, node)
    began = len(_log_lines(sbx, node, running, "allocations_ok="))
    wait_for(lambda: not _ready(sbx, node), timeout=EVICTION_TIMEOUT, what=f"{node} NotReady, cut off")
    # Still running, still held to 1024 MiB: four 256 MiB blocks, then refused.
    wait_for(
        lambda: len(_log_lines(sbx, node, running, "allocations_ok=")) >= began + 3,
        timeout=60,
        what="the probe running on while cut off",
    )
    assert set(_log_lines(sbx, node, running, "allocations_ok=")) == {"allocations_ok=4"}
    assert set(_log_lines(sbx, node, running, "total_mib=")) == {"total_mib=1024"}
    nodelife.heal_node(sbx.root, node)
    wait_for(lambda: _ready(sbx, node), timeout=EVICTION_TIMEOUT, what=f"{node} Ready again")
    again = sbx.core.read_namespaced_pod(running.metadata.name, "default")
    assert again.metadata.uid == running.metadata.uid and again.status.phase == "Running"
    assert all(s.restart_count == 0 for s in again.status.container_statuses or [])
    return again


def test_a_node_cut_off_from_the_control_plane_keeps_enforcing_its_pods_quotas(sbx: Sandbox) -> None:
    node = sbx.state.nodes[-1].name
    pod = _on_node(probe_pod("cut-off", 1024, 20), [node])
    pod["spec"]["containers"][0]["command"] = PROBE_LOOP
    kubeapi.create_pod(sbx.core, pod)
    running = sbx.wait_pod("cut-off", "Running", timeout=120)
    again = cut_off_and_rejoin(sbx, node, running)
    assert again.metadata.annotations[KEYS.allocation] == running.metadata.annotations[KEYS.allocation]
    _check_limits(sbx, again)


def _not_running(sbx: Sandbox) -> list[str]:
    """The pods in ``default`` that are not Running, each with why (test_chaos.describe)."""
    return [describe(p) for p in sbx.core.list_namespaced_pod("default").items if p.status.phase != "Running"]


def _scheduled_events(sbx: Sandbox, names: set[str]) -> dict[str, int]:
    """How many times each pod was bound, by kube-scheduler's Scheduled events: those of the pod of
    that name now (events outlive their pod, and an earlier test's pod may have had the name)."""
    uids = {p.metadata.uid: p.metadata.name for p in sbx.core.list_namespaced_pod("default").items}
    counts = dict.fromkeys(names, 0)
    for event in sbx.core.list_namespaced_event("default").items:
        name = uids.get(event.involved_object.uid)
        if event.reason == "Scheduled" and name in counts:
            counts[name] += event.count or 1
    return counts


@contextlib.contextmanager
def _cordoned(sbx: Sandbox, nodes: list[str]) -> Iterator[None]:
    """These nodes take no new pod while the block runs (`kubectl cordon`'s patch), and do again after."""
    for node in nodes:
        sbx.core.patch_node(node, {"spec": {"unschedulable": True}})
    try:
        yield
    finally:
        for node in nodes:
            sbx.core.patch_node(node, {"spec": {"unschedulable": False}})


def _lead_from(sbx: Sandbox, *, first: bool) -> str:
    """The leading tessera-scheduler pod once it runs on the first node (``first``) or on a further
    one. The nodes of the other kind are cordoned meanwhile, so that a deleted leader's replacement
    lands on a node of the kind wanted: the leader is deleted (it releases its lease on the way out)
    and the other replica leads, so after two deletions at most the leader is on that kind. (Without
    the cordon, the replacements went where the replicas' preferred anti-affinity put them, and in
    a CI run four deletions left both replicas on further nodes.) Both replicas are ready again
    before it returns."""

    def wanted(node: str) -> bool:
        return (node == sbx.state.node) == first

    others = [n.metadata.name for n in sbx.core.list_node().items if not wanted(n.metadata.name)]
    with _cordoned(sbx, others):
        for _ in range(3):
            wait_for(
                lambda: rolled_out(sbx) and bool(leader_pod(sbx)),
                timeout=120,
                what="both replicas, one leading",
            )
            leader = leader_pod(sbx)
            if wanted(str(sbx.core.read_namespaced_pod(leader, install.NAMESPACE).spec.node_name)):
                return leader
            sbx.core.delete_namespaced_pod(leader, install.NAMESPACE)
            wait_for(
                lambda old=leader: leader_pod(sbx) not in ("", old),
                timeout=60,
                what="the other replica to lead",
            )
    raise AssertionError(f"no replica on {'the first' if first else 'a further'} node came to lead")


@pytest.mark.parametrize("first", [True, False], ids=["on-the-first-node", "on-a-further-node"])
def test_losing_the_node_of_the_leading_scheduler_loses_no_scheduling(sbx: Sandbox, first: bool) -> None:
    leader = _lead_from(sbx, first=first)
    dead = str(sbx.core.read_namespaced_pod(leader, install.NAMESPACE).spec.node_name)
    lease = client.CoordinationV1Api(sbx.api).read_namespaced_lease(SCHEDULER, install.NAMESPACE)
    duration = float(lease.spec.lease_duration_seconds)
    others = [n.metadata.name for n in sbx.core.list_node().items if n.metadata.name != dead]
    names = [f"lead-{i:02d}" for i in range(20)]
    with _watched(sbx):
        for name in names[:10]:
            kubeapi.create_pod(sbx.core, _on_node(probe_pod(name, 512, 5, idle=True), others))
        wait_for(
            lambda: (
                sum(bool(sbx.core.read_namespaced_pod(n, "default").spec.node_name) for n in names[:10]) >= 3
            ),
            timeout=120,
            what="the first pods bound",
        )
        nodelife.stop_node(sbx.root, dead)
        began = time.monotonic()
        for name in names[10:]:
            kubeapi.create_pod(sbx.core, _on_node(probe_pod(name, 512, 5, idle=True), others))
        # The stopped replica renews nothing: its lease runs out and the other replica takes it.
        wait_for(
            lambda: leader_pod(sbx) not in ("", leader),
            timeout=4 * duration,
            what="the other replica to lead",
        )
        took = time.monotonic() - began
        print(f"the replica on {dead} stopped; the other led after {took:.1f}s (lease {duration:.0f}s)")
        # Within the lease's duration, plus its retry period and a loaded host's slack.
        assert took <= 2 * duration, f"took {took:.1f}s over a {duration:.0f}s lease"

        try:
            wait_for(lambda: len(sbx.core.list_namespaced_pod("default").items) == 20 and not _not_running(sbx),
                     timeout=300, what="all 20 pods placed and running on the other nodes")  # fmt: skip
        except AssertionError as e:
            raise AssertionError(f"{e}: {_not_running(sbx)[:10]}") from None
        # Every pod runs, so each was bound; none may have been bound twice. Not "exactly one event":
        # the replica on the stopped node sends its events in batches, and those of the pods it bound
        # just before its node went are lost with it (a cold run found four pods with none).
        twice = {n: c for n, c in _scheduled_events(sbx, set(names)).items() if c > 1}
        assert not twice, f"pods bound more than once: {twice}"


def _agents(sbx: Sandbox) -> list[Any]:
    return list(sbx.core.list_namespaced_pod(install.NAMESPACE, label_selector=install.AGENT_SELECTOR).items)


def _limits_files(state_dirs: dict[str, StateDir], pod_uids: set[str]) -> dict[Path, str]:
    """The limits files of these pods' containers, with their text, on every node (an earlier test's
    pods' are left alone: the agent removes them within its clean-up's period)."""
    found = {}
    for state in state_dirs.values():
        for where, record in state.records():
            if record.pod_uid in pod_uids:
                with contextlib.suppress(OSError):
                    found[where.limits] = where.limits.read_text()
    return found


# The release's image, and the tag of a rolling upgrade's "new release" (tag_rolled).
RELEASED_IMAGE = "docker.io/library/tessera:0.1.0"
ROLLED_TAG = "0.1.0-rolled"


def tag_rolled(sbx: Sandbox, nodes: list[str]) -> None:
    """The "new release": the release's image under ROLLED_TAG, in every node's containerd."""
    layout = Layout(sbx.root)
    rolled = f"{RELEASED_IMAGE.rpartition(':')[0]}:{ROLLED_TAG}"
    for node in nodes:
        node_layout = layout if node == sbx.state.node else layout.of_node(node)
        containerd.ctr(node_layout, "images", "tag", "--force", RELEASED_IMAGE, rolled)


def _upgrade(sbx: Sandbox, tag: str) -> None:
    helm(sbx, "upgrade", install.RELEASE, str(install.CHART), "--namespace", install.NAMESPACE,
         "--reuse-values", "--set", f"image.tag={tag}")  # fmt: skip


def _agents_on(sbx: Sandbox, nodes: list[str], rolled: bool) -> bool:
    """Every node's agent Ready, on the rolled tag (``rolled``) or else on the release's."""
    agents = _agents(sbx)
    return len(agents) == len(nodes) and all(
        p.spec.containers[0].image.endswith(ROLLED_TAG) == rolled and _pod_ready(p) for p in agents
    )


def roll(sbx: Sandbox, nodes: list[str], pod: Callable[[str], dict[str, Any]]) -> list[str]:
    """`helm upgrade` of the release to tag_rolled's image, until every node's agent runs it: the
    DaemonSet rolls node by node (watched every second, at most one node's agent unready at any
    moment). Meanwhile a pod a second, ``pod(name)``, is created (12 at most); returns their names."""
    unavailable: list[set[str]] = []
    created: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(1.0):
            ready = {p.spec.node_name for p in _agents(sbx) if _pod_ready(p)}
            unavailable.append(set(nodes) - ready)
            if len(created) < 12:
                name = f"rolling-{len(created):02d}"
                kubeapi.create_pod(sbx.core, pod(name))
                created.append(name)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        _upgrade(sbx, ROLLED_TAG)
        wait_for(lambda: _agents_on(sbx, nodes, rolled=True), timeout=300, what="every node's agent rolled")
    finally:
        stop.set()
        watcher.join()
    # Seen rolling (a node's agent away at some moment), never two nodes' agents at once.
    assert any(unavailable), "no agent seen replaced"
    assert max(len(u) for u in unavailable) <= 1, [sorted(u) for u in unavailable if u]
    return created


def roll_back(sbx: Sandbox, nodes: list[str]) -> None:
    """The release's own tag again on every node's agent, as the tests after this one expect."""
    _upgrade(sbx, "")
    wait_for(
        lambda: _agents_on(sbx, nodes, rolled=False), timeout=300, what="the agents back on the release's tag"
    )


def settle_roll(sbx: Sandbox, created: list[str]) -> dict[str, str]:
    """How each pod created during the roll settled (_settled), once each has: at least half of them
    Running."""
    try:
        wait_for(lambda: all(_settled(sbx, n) for n in created), timeout=180, what="the roll's pods settled")
    except AssertionError as e:
        raise AssertionError(f"{e}: {_not_running(sbx)}") from None
    settled = {n: str(_settled(sbx, n)) for n in created}
    assert sum(s == "Running" for s in settled.values()) >= len(created) // 2, settled
    return settled


def test_a_rolling_upgrade_goes_node_by_node_and_no_container_loses_its_quota(sbx: Sandbox) -> None:
    nodes = [n.metadata.name for n in sbx.core.list_node().items]
    tag_rolled(sbx, nodes)
    for i, node in enumerate(nodes):
        kubeapi.create_pod(sbx.core, _on_node(probe_pod(f"steady-{i}", 1024, 10, idle=True), [node]))
    steady = {sbx.wait_pod(f"steady-{i}", "Running", timeout=120).metadata.uid for i in range(len(nodes))}
    state_dirs = sbx.state_dirs()
    files = _limits_files(state_dirs, steady)
    assert len(files) == len(nodes)
    with _watched(sbx):
        admitted = roll(sbx, nodes, lambda name: probe_pod(name, 512, 5, idle=True))
        # No running container lost its quota or its limits file.
        assert _limits_files(state_dirs, steady) == files
        for i in range(len(nodes)):
            pod = sbx.core.read_namespaced_pod(f"steady-{i}", "default")
            assert all(s.restart_count == 0 for s in pod.status.container_statuses or [])
            _check_limits(sbx, pod)
        # Every pod admitted during the roll got exactly the quota it was placed with, and none was
        # refused by a kubelet (Rejected): an agent told to stop withdraws its heartbeat first and
        # serves until what was bound to its node is allocated, and the next one publishes its
        # heartbeat once registered (deviceplugin.handover). One created while a node had no
        # heartbeat waits, Pending, for kube-scheduler's retry.
        settled = settle_roll(sbx, admitted)
        assert "Rejected" not in settled.values(), settled
        for name, outcome in settled.items():
            if outcome == "Running":
                _check_limits(sbx, sbx.core.read_namespaced_pod(name, "default"))
        # Once rolled, the cluster places and admits GPU pods as before.
        kubeapi.create_pod(sbx.core, probe_pod("after-roll", 512, 5, idle=True))
        _check_limits(sbx, sbx.wait_pod("after-roll", "Running", timeout=180))
    roll_back(sbx, nodes)


def _settled(sbx: Sandbox, name: str) -> str | None:
    """Running; Rejected, refused by its node's kubelet before any container started; or Pending
    with kube-scheduler's reason; None while none of them."""
    pod = sbx.core.read_namespaced_pod(name, "default")
    if pod.status.phase == "Running":
        return "Running"
    if pod.status.reason == "UnexpectedAdmissionError" and not pod.status.container_statuses:
        return "Rejected"
    scheduled = next((c for c in pod.status.conditions or [] if c.type == "PodScheduled"), None)
    if scheduled is not None and scheduled.status == "False" and scheduled.reason == "Unschedulable":
        return "Pending"
    return None


def _pod_ready(pod: Any) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def test_down_removes_every_node_from_the_host(fleet: Sandbox, fleet_host_before: HostView) -> None:
    sandbox, before = fleet, fleet_host_before
    assert cluster.down(sandbox.root, report=lambda _: None) == []
    assert differences(before, sandbox.root) == []
