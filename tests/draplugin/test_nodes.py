"""The DRA path on three real nodes (`tessera sandbox up --mode dra --nodes 3`): Kubernetes 1.37, each
node a kubelet with its own containerd 2, fake GPUs and ``tessera-dra`` (the chart's DaemonSet),
placement by the cluster's kube-scheduler. What tests/sandbox/test_nodes.py asks of the device plugin
path, through claims: every node publishes its own GPUs and runs claim pods with their quotas; a node
that dies with claim pods on it has them recreated elsewhere, its claims kept allocated while its
pods may still run and its prepared claims cleaned when it returns; a drained node's claim pods move
with their quotas; a node cut off from the control plane keeps enforcing its pod's quota; a rolling
upgrade of the driver's DaemonSet goes node by node and leaves every prepared claim as it was; waves
of claim pods survive components killed at random (tests/sandbox/test_chaos.py's waves, on claims)."""

from __future__ import annotations

import contextlib
import copy
import random
import re
import threading
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, config
from kubernetes.utils import parse_quantity

from nodeagent.records import PreparedRecord
from nodeagent.statedir import StateDir
from sandbox import cluster, gpu, install, kubeapi, nodelife
from sandbox.controlplane import DRA_K8S_VERSION
from tessera.contract import COORDINATION_SLOT_SUFFIX, DRA_CORES_CAPACITY, DRA_MEMORY_CAPACITY, KEYS, MIB
from tests.draplugin.conftest import GROUP, VERSION, Cluster
from tests.draplugin.test_node import EXAMPLE, claim_files, driver_written, exec_probe, probe_container
from tests.sandbox.conftest import HostView, Sandbox, differences, restore, running_sandbox
from tests.sandbox.test_chaos import HOLDING, SEED, SHAPES_CORES, SHAPES_MIB, Chaos, Waves, waves_under_kills
from tests.sandbox.test_nodes import (
    EVICTION_TIMEOUT,
    PROBE_LOOP,
    _on_node,
    _pods_of,
    _ready,
    _running,
    cut_off_and_rejoin,
    deployment_of,
    drain,
    roll,
    roll_back,
    run_deployment,
    settle_roll,
    tag_rolled,
    uncordon,
    wait_moved,
    watching,
)
from tests.waiting import wait_for

pytestmark = pytest.mark.sandbox

NODES = 3
# vgpu-probe allocates blocks of this size until refused.
BLOCK_MIB = 256


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest) -> Iterator[tuple[Sandbox, HostView]]:
    with running_sandbox("dra-nodes", request.session, mode="dra", nodes=NODES) as running:
        yield running


@pytest.fixture
def sbx(fleet: tuple[Sandbox, HostView]) -> Iterator[Sandbox]:
    """The fleet, with every node running and joined again afterwards and the test's pods,
    Deployments, claim templates and claims in ``default`` gone."""
    sandbox = fleet[0]
    yield sandbox
    restore(sandbox)
    objects = client.CustomObjectsApi(sandbox.api)
    for template in objects.list_namespaced_custom_object(
        GROUP, VERSION, "default", "resourceclaimtemplates"
    )["items"]:
        kubeapi.delete(
            lambda t=template: objects.delete_namespaced_custom_object(
                GROUP, VERSION, "default", "resourceclaimtemplates", t["metadata"]["name"]
            )
        )
    wait_for(
        lambda: (
            not objects.list_namespaced_custom_object(GROUP, VERSION, "default", "resourceclaims")["items"]
        ),
        timeout=120,
        what="the claims of the test's pods deleted",
    )


def _view(sbx: Sandbox) -> Cluster:
    """The admin's view of ``default`` (claim templates, claims)."""
    return Cluster(sbx.api, "default")


def claim_pod(name: str, template: str, nodes: list[str], command: list[str] | None = None) -> dict[str, Any]:
    """deploy/examples/dra-shared-gpu.yaml's pod, its claim made from ``template``, on one of
    ``nodes``; ``command``: instead of the example's (vgpu-probe once, then idle)."""
    _, example = yaml.safe_load_all(EXAMPLE.read_text())
    pod: dict[str, Any] = copy.deepcopy(example)
    pod["metadata"] = {"name": name}
    pod["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": template}]
    container = probe_container()
    container["resources"] = {"claims": [{"name": "gpu"}]}
    if command is not None:
        container["command"] = command
    pod["spec"]["containers"] = [container]
    return _on_node(pod, nodes)


def _report(sbx: Sandbox, pod: str) -> dict[str, str]:
    """The probe's report ("key=value" lines) from the pod's log, once it was refused."""
    text = sbx.logs(pod, until="refused_with=", timeout=90)
    assert "refused_with=" in text, f"pod {pod}: {text!r}"
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def _check_quota(sbx: Sandbox, pod: str, memory_mib: int) -> None:
    report = _report(sbx, pod)
    assert (report["total_mib"], report["allocations_ok"]) == (
        str(memory_mib),
        str(memory_mib // BLOCK_MIB),
    ), (pod, report)


def _claim_of(sbx: Sandbox, pod: Any) -> dict[str, Any]:
    """The claim made for the pod from its template."""
    [status] = pod.status.resource_claim_statuses
    return _view(sbx).claim(status.resource_claim_name)


def _result(claim: dict[str, Any]) -> dict[str, Any] | None:
    """The claim's one allocated device, None while it is not allocated."""
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        return None
    [result] = allocation["devices"]["results"]
    return dict(result)


def _slices(api: client.ApiClient) -> list[dict[str, Any]]:
    found = client.CustomObjectsApi(api).list_cluster_custom_object(GROUP, VERSION, "resourceslices")
    return [s for s in found["items"] if s["spec"]["driver"] == KEYS.dra_driver]


def _gpus_of(sbx: Sandbox, node: str) -> set[tuple[str, str]]:
    """(UUID, model) of the node's fake GPUs, as the sandbox made them."""
    if node == sbx.state.node:
        return {(g.uuid, g.model) for g in gpu.SANDBOX_GPUS}
    further = sbx.state.further_node(node)
    return {(g.uuid, g.model) for g in gpu.node_gpus(further.name, further.gpus)}


@dataclass
class ClaimInvariants:
    """What must hold at every moment on the DRA path (a test_chaos.Watcher): no device's capacity
    is exceeded by the claims allocated on it, by the claims its node prepared, nor by what their
    processes hold (the hook's accounting region of each claim), no claim's processes hold more than
    its share, and every pod bound to a node and not finished has its claims allocated and reserved
    for it (never freed while the pod may run), each as it was allocated when first seen so (never
    moved under the pod).

    With ``control_plane_killed`` (kube-apiserver or etcd), two of these are kube-scheduler's to
    keep and it cannot always (docs/dra.md, "Allocated past a device's capacity"): a bind whose answer a kill cut off makes it
    undo the claims of a pod that is in fact bound. Claims then allocated past a device's capacity,
    and a pod not yet Running whose claim is not reserved for it a moment, are noted in ``lost``, not
    violations; the node's side (what it prepares, what runs) stays held to the rule."""

    kubeconfig: str
    capacity: dict[tuple[str, str], tuple[int, int]]  # (pool, device): (memory bytes, cores)
    uuids: dict[tuple[str, str], str]  # (pool, device): the GPU's UUID
    state_dirs: Mapping[str, StateDir]
    """Each node's Tessera state directory (its prepared claims' regions), by node name: its pool."""
    control_plane_killed: bool = False
    allocated: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Each claim's device, by claim UID, as first seen under a bound pod."""
    violations: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    """What kube-scheduler's lost binds caused, with ``control_plane_killed``."""
    checks: int = 0
    api: client.ApiClient = field(init=False)

    def __post_init__(self) -> None:
        self.api = config.new_client_from_config(config_file=self.kubeconfig)

    def _pods(self) -> dict[str, Any]:
        pods = kubeapi.retried(lambda: client.CoreV1Api(self.api).list_pod_for_all_namespaces().items)
        return {p.metadata.uid: p for p in pods}

    def _scheduler_broke(self, what: str) -> None:
        (self.lost if self.control_plane_killed else self.violations).append(what)

    def _prepared(self) -> list[tuple[str, PreparedRecord]]:
        """The claims each node has prepared, by node (its pool)."""
        return [
            (pool, r) for pool, state_dir in self.state_dirs.items() for _, r in state_dir.prepared_records()
        ]

    def _given(
        self, prepared: list[tuple[str, PreparedRecord]], allocated: set[str]
    ) -> dict[tuple[str, str], list[int]]:
        """What the prepared claims still ``allocated`` (by UID) give each device: (memory bytes,
        cores). A claim deleted or deallocated before its node unprepared it (its pod deleted at once,
        its kubelet down) holds nothing the scheduler or the driver counts (docs/dra.md)."""
        where_of = {(where[0], uuid): where for where, uuid in self.uuids.items()}
        given: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        for pool, record in prepared:
            if record.uid not in allocated:
                continue
            for quota in record.quotas:
                where = where_of[(pool, quota.uuid)]
                given[where][0] += quota.memory_quota_bytes
                given[where][1] += quota.cores
        return given

    def check(self) -> None:
        # Records first, claims after: a claim allocated when listed was allocated when its record
        # was read (a claim UID, once deallocated, never is again), so the records counted are ones
        # the driver counted too, and never more than it had prepared at one moment.
        prepared = self._prepared()
        # Pods, claims, pods again: a pod in both lists existed while the claims were listed.
        before = self._pods()
        claims = kubeapi.retried(
            lambda: client.CustomObjectsApi(self.api).list_cluster_custom_object(
                GROUP, VERSION, "resourceclaims"
            )
        )["items"]
        after = self._pods()
        given = self._given(prepared, {c["metadata"]["uid"] for c in claims if _result(c) is not None})
        used: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        on: dict[tuple[str, str], list[tuple[Any, int, int]]] = defaultdict(list)  # for the message
        held: dict[tuple[str, str], int] = defaultdict(int)
        by_name = {(c["metadata"]["namespace"], c["metadata"]["name"]): c for c in claims}
        for claim in claims:
            result = _result(claim)
            if result is None or result["driver"] != KEYS.dra_driver:
                continue
            consumed = result.get("consumedCapacity") or {}
            where = (result["pool"], result["device"])
            memory = int(parse_quantity(consumed.get(DRA_MEMORY_CAPACITY, "0")))
            cores = int(parse_quantity(consumed.get(DRA_CORES_CAPACITY, "0")))
            used[where][0] += memory
            used[where][1] += cores
            on[where].append((claim, memory, cores))
            state_dir = self.state_dirs.get(result["pool"])
            usage = state_dir.claim(claim["metadata"]["uid"]).usage() if state_dir else None
            device = usage.device(self.uuids[where]) if usage else None
            if device is None:  # not prepared yet, no process on the GPU yet, or unprepared
                continue
            held[where] += device.memory_used_bytes
            if device.memory_used_bytes > memory:
                self.violations.append(
                    f"claim {claim['metadata']['name']}: holds {device.memory_used_bytes} bytes on "
                    f"{where} over its {memory}"
                )
        for where, (total_memory, total_cores) in self.capacity.items():
            memory, cores = used.get(where, (0, 0))
            if memory > total_memory or cores > total_cores:
                self._scheduler_broke(
                    f"{where}: claims allocate {memory // MIB}/{total_memory // MIB} MiB, "
                    f"{cores}/{total_cores} cores: "
                    + "; ".join(f"{_story(c)} {m // MIB} MiB {n} cores" for c, m, n in on[where])
                )
            memory, cores = given.get(where, (0, 0))
            if memory > total_memory or cores > total_cores:
                self.violations.append(
                    f"{where}: its node prepared claims of {memory // MIB}/{total_memory // MIB} MiB, "
                    f"{cores}/{total_cores} cores"
                )
            if held[where] > total_memory:
                self.violations.append(f"{where}: claims hold {held[where]} bytes of {total_memory}")
        for uid, pod in before.items():
            # Finished by the second list, it may have finished before the claims were listed, and
            # a finished pod's claims are freed.
            finished = ("Succeeded", "Failed")
            if (
                uid not in after
                or not pod.spec.node_name
                or pod.status.phase in finished
                or after[uid].status.phase in finished
            ):
                continue
            for status in pod.status.resource_claim_statuses or []:
                claim = by_name.get((pod.metadata.namespace, status.resource_claim_name))
                reserved = [r["uid"] for r in ((claim or {}).get("status") or {}).get("reservedFor", [])]
                result = _result(claim) if claim is not None else None
                if claim is None or result is None or uid not in reserved:
                    what = (
                        f"pod {pod.metadata.name} on {pod.spec.node_name} ({pod.status.phase}, deleted "
                        f"{pod.metadata.deletion_timestamp}): claim {status.resource_claim_name} "
                        f"not allocated and reserved for it: {_story(claim) if claim else 'no such claim'}"
                    )
                    # Running, its containers were started with the claim prepared: it must keep it.
                    if "Running" in (pod.status.phase, after[uid].status.phase):
                        self.violations.append(what)
                    else:
                        self._scheduler_broke(what)
                    continue
                first = self.allocated.setdefault(claim["metadata"]["uid"], result)
                if result != first:
                    self.violations.append(
                        f"pod {pod.metadata.name}: claim {status.resource_claim_name} allocated {first}, "
                        f"now {result}"
                    )
        self.checks += 1

    def watch(self, stop: threading.Event) -> None:
        """Checks at once, then every 2 s until stopped (a quick test is checked too)."""
        while True:
            try:
                self.check()
            except AssertionError as e:  # the API down past kubeapi.retried()'s patience
                self.violations.append(str(e))
            if stop.wait(2.0):
                return


def _story(claim: Mapping[str, Any]) -> str:
    """The claim, its allocation and its reservations, for a failure message."""
    status = claim.get("status") or {}
    pods = ",".join(f"{r['name']}/{r['uid'][:8]}" for r in status.get("reservedFor", []))
    return (
        f"claim {claim['metadata']['name']} ({claim['metadata']['uid'][:8]}, made "
        f"{claim['metadata']['creationTimestamp']}, deleted {claim['metadata'].get('deletionTimestamp')}, "
        f"allocated {'yes' if status.get('allocation') else 'no'}, reserved for [{pods}])"
    )


def _devices(api: client.ApiClient) -> dict[tuple[str, str], dict[str, Any]]:
    """Every device the driver published, by (pool, device name) as a claim's result names it."""
    return {(s["spec"]["pool"]["name"], d["name"]): d for s in _slices(api) for d in s["spec"]["devices"]}


def _claim_invariants(sbx: Sandbox, *, control_plane_killed: bool = False) -> ClaimInvariants:
    devices = _devices(sbx.api)
    capacity = {
        where: (
            int(d["capacity"][DRA_MEMORY_CAPACITY]["value"]),
            int(d["capacity"][DRA_CORES_CAPACITY]["value"]),
        )
        for where, d in devices.items()
    }
    uuids = {where: d["attributes"]["uuid"]["string"] for where, d in devices.items()}
    return ClaimInvariants(sbx.state.kubeconfig, capacity, uuids, sbx.state_dirs(), control_plane_killed)


def _watched(sbx: Sandbox) -> contextlib.AbstractContextManager[ClaimInvariants]:
    """No device overcommitted and no claim freed or moved under a pod, checked every 2 s."""
    return watching(_claim_invariants(sbx))


def test_every_node_publishes_its_own_gpus_and_runs_claim_pods_with_their_quotas(sbx: Sandbox) -> None:
    nodes = [sbx.state.node, *(n.name for n in sbx.state.nodes)]
    assert len(nodes) == NODES and all(_ready(sbx, n) for n in nodes)
    for node in sbx.core.list_node().items:
        info = node.status.node_info
        assert info.kubelet_version == DRA_K8S_VERSION, (node.metadata.name, info.kubelet_version)
        assert info.container_runtime_version.startswith("containerd://2."), info.container_runtime_version
    agents = sbx.core.list_namespaced_pod(install.NAMESPACE, label_selector=install.AGENT_SELECTOR).items
    assert sorted(p.spec.node_name for p in agents) == sorted(nodes)

    # Each node's one slice, of its own pool, lists its own GPUs: a mixed fleet.
    published = {
        s["spec"]["nodeName"]: (
            s["spec"]["pool"]["name"],
            {
                (d["attributes"]["uuid"]["string"], d["attributes"]["productName"]["string"])
                for d in s["spec"]["devices"]
            },
        )
        for s in _slices(sbx.api)
    }
    assert published == {n: (n, _gpus_of(sbx, n)) for n in nodes}
    assert len({frozenset(m for _, m in gpus) for _, gpus in published.values()}) == NODES, published

    # A claim pod on every node, each held to its own claim's memory.
    view = _view(sbx)
    with _watched(sbx):
        for i, node in enumerate(nodes):
            view.create_claim_template(f"share-{i}", {"memory": f"{1024 + 512 * i}Mi", "cores": "20"})
            kubeapi.create_pod(sbx.core, claim_pod(f"claimed-{i}", f"share-{i}", [node]))
        for i, node in enumerate(nodes):
            pod = sbx.wait_pod(f"claimed-{i}", "Running", timeout=120)
            assert pod.spec.node_name == node
            result = _result(_claim_of(sbx, pod))
            assert result is not None and result["pool"] == node, result
            _check_quota(sbx, f"claimed-{i}", 1024 + 512 * i)


def test_a_dead_nodes_claim_pods_move_and_its_prepared_claims_go_when_it_returns(sbx: Sandbox) -> None:
    further = [n.name for n in sbx.state.nodes]
    _view(sbx).create_claim_template("survivor", {"memory": "4Gi", "cores": "20"})
    with _watched(sbx):
        before = run_deployment(sbx, deployment_of("survivor", 3, claim_pod("survivor", "survivor", further)))
        counts = {n: sum(p.spec.node_name == n for p in before) for n in further}
        victim = max(counts, key=lambda n: counts[n])
        doomed = {
            p.metadata.uid: _claim_of(sbx, p)["metadata"]["uid"] for p in before if p.spec.node_name == victim
        }
        assert doomed
        prepared = {p.name for p in sbx.state_dirs()[victim].claims.iterdir()}
        assert set(doomed.values()) <= prepared, (doomed, prepared)

        nodelife.stop_node(sbx.root, victim)
        wait_for(lambda: not _ready(sbx, victim), timeout=EVICTION_TIMEOUT, what=f"{victim} NotReady")

        wait_moved(sbx, "survivor", 3, victim, timeout=EVICTION_TIMEOUT)
        for pod in _running(_pods_of(sbx, "survivor")):
            _check_quota(sbx, pod.metadata.name, 4096)
        # The dead node's pods are still there (Terminating: no kubelet confirms they stopped), and so
        # are their claims, allocated on the dead node's devices and reserved for them.
        left = [p for p in _pods_of(sbx, "survivor") if p.spec.node_name == victim]
        assert {p.metadata.uid for p in left} == doomed.keys()
        for pod in left:
            claim = _claim_of(sbx, pod)
            result = _result(claim)
            assert result is not None and result["pool"] == victim, claim
            assert pod.metadata.uid in [r["uid"] for r in claim["status"]["reservedFor"]], claim

        replacements = {
            p.metadata.uid: _result(_claim_of(sbx, p)) for p in _running(_pods_of(sbx, "survivor"))
        }
        nodelife.start_node(sbx.root, victim)
        wait_for(
            lambda: not any(p.spec.node_name == victim for p in _pods_of(sbx, "survivor")),
            timeout=EVICTION_TIMEOUT,
            what=f"the old pods deleted once {victim}'s kubelet is back",
        )

        def deallocated() -> bool:
            claims = _view(sbx).objects.list_namespaced_custom_object(
                GROUP, VERSION, "default", "resourceclaims"
            )
            return not any(
                c["metadata"]["uid"] in doomed.values() and _result(c) is not None for c in claims["items"]
            )

        wait_for(deallocated, timeout=120, what="the old pods' claims deallocated")
        # The driver on the node again unprepared them: no record, limits file or CDI spec left.
        wait_for(
            lambda: not any(uid in f for uid in doomed.values() for f in claim_files(sbx, victim)),
            timeout=180,
            what=f"{victim}'s prepared claims of the deleted pods cleaned",
        )
        # Nothing of the new pods was disturbed.
        after = {p.metadata.uid: p for p in _running(_pods_of(sbx, "survivor"))}
        assert after.keys() == replacements.keys()
        for uid, pod in after.items():
            assert _result(_claim_of(sbx, pod)) == replacements[uid]
            assert all(s.restart_count == 0 for s in pod.status.container_statuses or [])


def test_drain_moves_claim_pods_with_their_quotas_and_uncordon_brings_the_node_back(sbx: Sandbox) -> None:
    further = [n.name for n in sbx.state.nodes]
    _view(sbx).create_claim_template("drained", {"memory": "2Gi", "cores": "30"})
    with _watched(sbx):
        first = run_deployment(sbx, deployment_of("drained", 2, claim_pod("drained", "drained", further)))[0]
        victim = first.spec.node_name
        moving = _claim_of(sbx, first)["metadata"]["uid"]
        drain(sbx, victim)
        wait_moved(sbx, "drained", 2, victim)
        for pod in _running(_pods_of(sbx, "drained")):
            _check_quota(sbx, pod.metadata.name, 2048)
        wait_for(
            lambda: not any(moving in f for f in claim_files(sbx, victim)),
            timeout=90,
            what=f"the moved pod's claim unprepared on {victim}",
        )
        uncordon(sbx, victim)


def test_a_node_cut_off_from_the_control_plane_keeps_enforcing_its_claims_quota(sbx: Sandbox) -> None:
    node = sbx.state.nodes[-1].name
    _view(sbx).create_claim_template("cut-off", {"memory": "1Gi", "cores": "20"})
    kubeapi.create_pod(sbx.core, claim_pod("cut-off", "cut-off", [node], PROBE_LOOP))
    running = sbx.wait_pod("cut-off", "Running", timeout=120)
    allocated = _result(_claim_of(sbx, running))
    again = cut_off_and_rejoin(sbx, node, running)
    assert _result(_claim_of(sbx, again)) == allocated


def _as_prepared(sbx: Sandbox, pod: Any) -> tuple[dict[str, Any] | None, dict[str, bytes], dict[str, int]]:
    """The pod's claim as prepared on its node: its allocated device, the files the driver wrote for
    it, and when it wrote those only it writes (limits, CDI spec, record; not the coordination slot,
    which the claim's processes write)."""
    claim = _claim_of(sbx, pod)
    written = driver_written(sbx, claim["metadata"]["uid"], pod.spec.node_name)
    at = {f: Path(f).stat().st_mtime_ns for f in written if not f.endswith(COORDINATION_SLOT_SUFFIX)}
    return _result(claim), written, at


def test_a_rolling_upgrade_goes_node_by_node_and_no_claim_pod_loses_its_quota(sbx: Sandbox) -> None:
    nodes = [sbx.state.node, *(n.name for n in sbx.state.nodes)]
    tag_rolled(sbx, nodes)
    view = _view(sbx)
    view.create_claim_template("steady", {"memory": "1Gi", "cores": "10"})
    view.create_claim_template("rolling", {"memory": "512Mi", "cores": "5"})
    for i, node in enumerate(nodes):
        kubeapi.create_pod(sbx.core, claim_pod(f"steady-{i}", "steady", [node]))
    steady = {}
    for i in range(len(nodes)):
        pod = sbx.wait_pod(f"steady-{i}", "Running", timeout=120)
        _check_quota(sbx, pod.metadata.name, 1024)
        steady[pod.metadata.name] = (pod, _as_prepared(sbx, pod))
        assert {Path(f).name for f in steady[pod.metadata.name][1][2]} >= {"limits", "prepared.json"}
    with _watched(sbx):
        created = roll(sbx, nodes, lambda name: claim_pod(name, "rolling", nodes))
        # No running claim pod lost its quota: never restarted, its claim allocated as it was and
        # still prepared (no file of it removed or written again by the new driver), and a new
        # process in it held to its share.
        for name, (pod, prepared) in steady.items():
            again = sbx.core.read_namespaced_pod(name, "default")
            assert again.metadata.uid == pod.metadata.uid
            assert all(s.restart_count == 0 for s in again.status.container_statuses or [])
            assert _as_prepared(sbx, again) == prepared, name
            report = exec_probe(view, name)
            assert (report["total_mib"], report["allocations_ok"]) == ("1024", str(1024 // BLOCK_MIB)), report
        # Every claim pod created during the roll runs with exactly its share, on the node its claim
        # was allocated on. One bound to a node while its driver was away waits (the kubelet retries
        # the claim's prepare until a driver answers): never refused, never run unprepared.
        settled = settle_roll(sbx, created)
        assert "Rejected" not in settled.values(), settled
        for name in (n for n, how in settled.items() if how == "Running"):
            pod = sbx.core.read_namespaced_pod(name, "default")
            result = _result(_claim_of(sbx, pod))
            assert result is not None and result["pool"] == pod.spec.node_name, (name, result)
            _check_quota(sbx, name, 512)
        # Once rolled, a new claim pod runs with its share.
        kubeapi.create_pod(sbx.core, claim_pod("after-roll", "rolling", nodes))
        sbx.wait_pod("after-roll", "Running", timeout=180)
        _check_quota(sbx, "after-roll", 512)
    roll_back(sbx, nodes)


# The kills of the DRA path: a node's driver (``tessera-dra``, its DaemonSet pod's container), any
# node's kubelet or containerd, kube-apiserver, etcd.
CHAOS_COMPONENTS = ("dra", "kubelet", "containerd", "kube-apiserver", "etcd")
# How a wave's pod may fail under the kills (its container's terminated state; the pods never
# restart): its container's processes SIGKILLed (exit 137, not the kernel's OOM killer) or lost by
# a restarted kubelet (ContainerStatusUnknown, the kubelet's 137), or its container started while
# containerd was being killed (StartError, containerd's connection gone) or while the kubelet was
# (StartError "failed to create shim task: context canceled": the kubelet's call, gone with it,
# cancelled the start; seen in CI). A container that ended on its own (the probe's exit 1: no quota
# held) or was refused its claim's CDI device is no kill's.
CONTAINERD_GONE = re.compile(
    r"connection refused|connection reset|ttrpc: closed|transport is closing|EOF|context canceled"
)


def _killed(pod: Any) -> bool:
    ended = [
        s.state.terminated for s in pod.status.container_statuses or [] if s.state and s.state.terminated
    ]
    return bool(ended) and all(
        (t.exit_code == 137 and t.reason != "OOMKilled")
        or t.reason == "ContainerStatusUnknown"
        or (t.reason == "StartError" and CONTAINERD_GONE.search(t.message or "") is not None)
        for t in ended
    )


def _share_template(mib: int, cores: int) -> str:
    return f"chaos-{mib}mi-{cores}"


def test_waves_of_claim_pods_survive_components_killed_at_random_across_nodes(sbx: Sandbox) -> None:
    """test_chaos's waves on the DRA path: 300 claim pods of mixed shares (each its own claim from a
    template), placed by kube-scheduler across the nodes while the kills go on; no device's claims
    prepared past its capacity (kube-scheduler's allocations past it, after binds a kill cut off, are
    reported: ClaimInvariants), no claim freed or moved under its running pod, every Running pod's
    container sees exactly its claim's share."""
    nodes = [sbx.state.node, *(n.name for n in sbx.state.nodes)]
    view = _view(sbx)
    for mib in SHAPES_MIB:
        for cores in SHAPES_CORES:
            view.create_claim_template(
                _share_template(mib, cores), {"memory": f"{mib}Mi", "cores": str(cores)}
            )
    invariants = _claim_invariants(
        sbx, control_plane_killed=bool({"kube-apiserver", "etcd"} & set(CHAOS_COMPONENTS))
    )
    rng = random.Random(SEED)

    def wave_pod(name: str) -> dict[str, Any]:
        return claim_pod(
            name, _share_template(rng.choice(SHAPES_MIB), rng.choice(SHAPES_CORES)), nodes, HOLDING
        )

    def claim_limits(pod: Any) -> dict[str, set[str]]:
        """The device line the driver writes for the pod's claim, which all its containers share."""
        result = _result(kubeapi.retried(lambda: _claim_of(sbx, pod)))
        assert result is not None and result["pool"] == pod.spec.node_name, (pod.metadata.name, result)
        consumed = result["consumedCapacity"]
        line = (
            f"device {invariants.uuids[(result['pool'], result['device'])]} memory "
            f"{int(parse_quantity(consumed[DRA_MEMORY_CAPACITY]))} cores {int(consumed[DRA_CORES_CAPACITY])}"
        )
        return {c.name: {line} for c in pod.spec.containers}

    chaos = Chaos(sbx.root, random.Random(SEED + 1), nodes, CHAOS_COMPONENTS)

    def freed() -> bool:
        """The deleted wave's claims gone (their capacity free): no claim is left in ``default``."""
        listed = kubeapi.retried(
            lambda: client.CustomObjectsApi(invariants.api).list_namespaced_custom_object(
                GROUP, VERSION, "default", "resourceclaims"
            )
        )
        return not listed["items"]

    waves = Waves(client.CoreV1Api(invariants.api), invariants.check, wave_pod, claim_limits, _killed, freed)

    def back() -> None:
        """Every node Ready, its driver's pod Ready and its devices published again."""
        wait_for(
            lambda: all(
                _ready(sbx, n)
                and install.agent_ready(sbx.api, n)
                and cluster.node_slice_devices(sbx.api, n) > 0
                for n in nodes
            ),
            timeout=240,
            what="every node Ready with its driver back",
        )

    try:
        waves_under_kills(chaos, invariants, waves, back)
    finally:
        distinct = dict.fromkeys(invariants.lost)
        print(
            f"kube-scheduler's lost binds at work: {len(distinct)} findings, {len(invariants.lost)} in all checks"
        )
        for what in distinct:
            print(f"  {what}")


def test_down_removes_every_node_from_the_host(fleet: tuple[Sandbox, HostView]) -> None:
    sandbox, before = fleet
    assert cluster.down(sandbox.root, report=lambda _: None) == []
    assert differences(before, sandbox.root) == []
