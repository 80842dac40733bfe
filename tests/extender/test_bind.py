"""/bind's decisions against a stand-in for the API server (the real one is in test_k8s.py): one
write, preconditions, retries after a conflict, idempotence, nothing counted after a failure."""

from __future__ import annotations

import asyncio
import copy
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from extender.filtering import FilterAnswer
from extender.kube import ApiError
from extender.leader import LeaderLease
from extender.metrics import Metrics
from extender.service import Extender
from extender.state import ClusterState
from tessera.contract import KEYS, JsonObject, Phase, QosClass, parse_allocation
from tessera.placement import PlacementEngine, QosThresholds, SpeedProfiles
from tests.extender.helpers import gpu_pod, inventory, node_object

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


class FakeApi:
    """The two calls bind makes, with the API server's preconditions and its binding rule."""

    def __init__(self, pods: list[JsonObject]) -> None:
        self.pods = {p["metadata"]["name"]: p for p in pods}
        self.version = 100
        self.binds = 0
        self.fail_next_bind: ApiError | None = None
        self.lease_holder = ""
        self.lease_error: ApiError | None = None
        self.events: list[tuple[str, str, str, bool]] = []  # (pod, reason, message, warning)

    def pod(self, name: str) -> JsonObject:
        if name not in self.pods:
            raise ApiError(404, f'pods "{name}" not found')
        return copy.deepcopy(self.pods[name])

    async def get_pod(self, namespace: str, name: str) -> JsonObject:
        return self.pod(name)

    async def get_lease(self, namespace: str, name: str) -> JsonObject:
        assert (namespace, name) == ("tessera-system", "tessera-scheduler")
        if self.lease_error is not None:
            raise self.lease_error
        return {"spec": {"holderIdentity": self.lease_holder}}

    async def list(self, path: str, field_selector: str = "") -> tuple[list[JsonObject], str]:
        """The pods bound to one node (bind's ``spec.nodeName=<node>``), as the API server lists them."""
        assert path == "/api/v1/pods" and field_selector.startswith("spec.nodeName="), (path, field_selector)
        node = field_selector.removeprefix("spec.nodeName=")
        return [copy.deepcopy(p) for p in self.pods.values() if p["spec"].get("nodeName") == node], str(
            self.version
        )

    async def create_event(self, pod: JsonObject, *, reason: str, message: str, warning: bool) -> None:
        self.events.append((pod["metadata"]["name"], reason, message, warning))

    def touch(self, name: str) -> None:
        self.version += 1
        self.pods[name]["metadata"]["resourceVersion"] = str(self.version)

    async def bind_pod(
        self,
        namespace: str,
        name: str,
        *,
        uid: str,
        resource_version: str,
        node: str,
        annotations: dict[str, str],
    ) -> None:
        self.binds += 1
        if self.fail_next_bind is not None:
            error, self.fail_next_bind = self.fail_next_bind, None
            raise error
        pod = self.pods[name]
        if pod["metadata"]["uid"] != uid or (
            resource_version and pod["metadata"]["resourceVersion"] != resource_version
        ):
            raise ApiError(409, "Precondition failed")
        if pod["spec"].get("nodeName"):
            raise ApiError(409, f'pod {name} is already assigned to node "{pod["spec"]["nodeName"]}"')
        pod["spec"]["nodeName"] = node
        pod["metadata"]["annotations"].update(annotations)
        self.touch(name)


def api_pod(name: str, **kwargs: Any) -> JsonObject:
    pod = gpu_pod(name, uid=f"uid-{name}", **kwargs)
    pod["metadata"]["resourceVersion"] = "1"
    return pod


@pytest.fixture
def state() -> ClusterState:
    s = ClusterState(PlacementEngine(SpeedProfiles()), KEYS, heartbeat_timeout=timedelta(minutes=5))
    s.replace_nodes([node_object("n", inventory("n", "Tesla T4", 15360, count=1, split=4), NOW)], NOW)
    s.replace_pods([])
    return s


def extender(
    state: ClusterState,
    api: FakeApi,
    qos_thresholds: QosThresholds | None = None,
    leader: LeaderLease | None = None,
) -> Extender:
    return Extender(
        state,
        api,  # type: ignore[arg-type]
        KEYS,
        Metrics(),
        inflight_timeout=timedelta(minutes=5),
        clock=lambda: NOW,
        inflight_wait=timedelta(milliseconds=50),
        qos_thresholds=qos_thresholds,
        leader=leader,
    )


def bind(ext: Extender, namespace: str, name: str, uid: str, node: str) -> str:
    return asyncio.run(ext.bind(namespace, name, uid, node))


def used(state: ClusterState) -> int:
    return state.engine.nodes["n"].gpus[0].used_memory_mib


def test_bind_writes_the_allocation_with_the_binding_and_counts_it_at_once(state: ClusterState) -> None:
    api = FakeApi([api_pod("p")])
    assert bind(extender(state, api), "default", "p", "uid-p", "n") == ""
    annotations = api.pods["p"]["metadata"]["annotations"]
    assert parse_allocation(annotations[KEYS.allocation]).containers[0].gpus[0].uuid == "GPU-n-0"
    assert annotations[KEYS.allocation_phase] == Phase.ALLOCATING
    assert annotations[KEYS.bind_time] == "2026-01-01T12:00:00Z"
    assert api.binds == 1
    assert used(state) == 4096


def test_a_conflict_is_retried_with_the_pod_read_again(state: ClusterState) -> None:
    api = FakeApi([api_pod("p")])
    ext = extender(state, api)
    ext.filter(api.pod("p"), ["n"])
    # The pod changes between bind's read and its write: the Binding's precondition fails.
    api.fail_next_bind = ApiError(409, "Precondition failed")
    assert bind(ext, "default", "p", "uid-p", "n") == ""
    assert api.binds == 2
    assert used(state) == 4096


def test_bind_decides_from_the_api_copy_not_the_filter_body(state: ClusterState) -> None:
    """A filter body carrying a real pod's name and UID but smaller requests must not decide what
    the pod gets: bind reads the pod and places what it asks for."""
    api = FakeApi([api_pod("p", memory=12000, cores=90)])
    ext = extender(state, api)
    forged = api.pod("p")
    limits = forged["spec"]["containers"][0]["resources"]["limits"]
    limits[KEYS.vgpu_memory], limits[KEYS.vgpu_cores] = "1024", "5"
    assert ext.filter(forged, ["n"]).passed == ["n"]  # reserved 1024 MiB / 5 cores
    assert bind(ext, "default", "p", "uid-p", "n") == ""
    grant = parse_allocation(api.pods["p"]["metadata"]["annotations"][KEYS.allocation]).containers[0].gpus[0]
    assert (grant.memory_quota_mib, grant.cores) == (12000, 90)
    assert used(state) == 12000


def test_bind_refuses_a_pod_of_another_scheduler(state: ClusterState) -> None:
    api = FakeApi([api_pod("p", scheduler="default-scheduler")])
    ext = extender(state, api)
    ext.filter(api.pod("p"), ["n"])
    assert bind(ext, "default", "p", "uid-p", "n") == (
        "pod default/p names scheduler 'default-scheduler'; this extender binds for tessera-scheduler"
    )
    assert api.binds == 0
    assert used(state) == 0  # and its reservation is gone
    assert ext.metrics.bind_failures.labels("scheduler")._value.get() == 1


def test_bind_of_a_pod_that_does_not_exist_drops_its_reservation(state: ClusterState) -> None:
    api = FakeApi([])
    ext = extender(state, api)
    assert ext.filter(gpu_pod("ghost", uid="uid-ghost", memory=15000), ["n"]).passed == ["n"]
    assert used(state) == 15000  # reserved
    assert bind(ext, "default", "ghost", "uid-ghost", "n").startswith(
        "pod default/ghost: cannot read it: HTTP 404"
    )
    assert used(state) == 0


def test_a_retried_bind_that_went_through_is_a_success(state: ClusterState) -> None:
    api = FakeApi([api_pod("p")])
    ext = extender(state, api)
    assert bind(ext, "default", "p", "uid-p", "n") == ""
    state.delete_pod("uid-p")  # as if the extender restarted before the watch caught up
    assert bind(ext, "default", "p", "uid-p", "n") == ""
    assert used(state) == 4096  # counted again from the pod's annotation


def test_bind_counts_the_pods_on_the_node_that_its_watch_has_not_shown_yet(state: ClusterState) -> None:
    """After a failover the new leader's watch may lag the binds of the previous one: bind lists the
    node's pods first, so a pod bound there a moment ago is counted by the capacity and by the
    in-flight rule (here: one in flight at 4096 MiB, so a 2048 MiB pod must wait, not bind)."""
    api = FakeApi([api_pod("p"), api_pod("q", memory=2048)])
    other = extender(
        ClusterState(state.engine.__class__(SpeedProfiles()), KEYS, heartbeat_timeout=timedelta(minutes=5)),
        api,
    )
    other.state.replace_nodes(
        [node_object("n", inventory("n", "Tesla T4", 15360, count=1, split=4), NOW)], NOW
    )
    other.state.replace_pods([])
    assert bind(other, "default", "p", "uid-p", "n") == ""  # the previous leader binds p
    assert used(state) == 0  # this extender's watch has not shown it yet
    refused = bind(extender(state, api), "default", "q", "uid-q", "n")
    assert "in flight" in refused, refused
    assert used(state) == 4096  # p, counted from the node's list
    assert "nodeName" not in api.pods["q"]["spec"]


def test_only_the_leading_replica_binds(state: ClusterState) -> None:
    """Beside a leader-elected kube-scheduler, an extender binds only while its own scheduler holds
    the Lease: a replica that lost it (or released it on its way out) may still have binds queued."""
    api = FakeApi([api_pod("p")])
    ext = extender(state, api, leader=LeaderLease("tessera-system", "tessera-scheduler", "sched-a"))
    for holder in ("sched-b_4f1d", ""):
        api.lease_holder = holder
        refused = bind(ext, "default", "p", "uid-p", "n")
        assert refused == (
            "pod default/p: this extender's scheduler (sched-a) does not hold the lease "
            f"tessera-system/tessera-scheduler (held by {holder or 'nobody'}); the leader binds"
        )
        assert api.binds == 0 and used(state) == 0
    assert ext.metrics.bind_failures.labels("not_leader")._value.get() == 2
    # A lease that cannot be read is no verdict on the pod: not bound, and not reported gone.
    api.lease_error = ApiError(404, 'leases.coordination.k8s.io "tessera-scheduler" not found')
    assert bind(ext, "default", "p", "uid-p", "n") == (
        "pod default/p: cannot read the lease tessera-system/tessera-scheduler: HTTP 404: "
        'leases.coordination.k8s.io "tessera-scheduler" not found'
    )
    assert ext.metrics.bind_failures.labels("gone")._value.get() == 0
    api.lease_error = None
    api.lease_holder = "sched-a_9c2e"
    assert bind(ext, "default", "p", "uid-p", "n") == ""
    assert used(state) == 4096


def test_a_failed_bind_counts_nothing(state: ClusterState) -> None:
    api = FakeApi([api_pod("p")])
    api.fail_next_bind = ApiError(500, "etcd is down")
    error = bind(extender(state, api), "default", "p", "uid-p", "n")
    assert error == "pod default/p: binding to n failed: HTTP 500: etcd is down"
    assert used(state) == 0
    assert "nodeName" not in api.pods["p"]["spec"]


def test_a_bind_cancelled_on_its_way_counts_nothing(state: ClusterState) -> None:
    """The extender stopping while the binding is on its way: whether it went through is unknown, and
    an assumption kept would count a pod that may never be bound (and that no watch event removes)."""
    api = FakeApi([api_pod("p")])

    async def cancelled(*_args: Any, **_kwargs: Any) -> None:
        raise asyncio.CancelledError

    api.bind_pod = cancelled  # type: ignore[method-assign]
    with pytest.raises(asyncio.CancelledError):
        bind(extender(state, api), "default", "p", "uid-p", "n")
    assert used(state) == 0 and state.nodes_with_inflight() == set()


def test_refusals_name_the_reason(state: ClusterState) -> None:
    api = FakeApi([api_pod("big", memory=16000), api_pod("other")])
    ext = extender(state, api)
    assert bind(ext, "default", "big", "uid-big", "n") == (
        "pod default/big no longer fits on node n: no GPU with 16000 MiB of memory; largest has 15360 MiB"
    )
    assert bind(ext, "default", "gone", "uid-gone", "n").startswith(
        "pod default/gone: cannot read it: HTTP 404"
    )
    assert (
        bind(ext, "default", "other", "uid-else", "n")
        == "pod default/other is now UID uid-other, not uid-else"
    )


def test_the_inflight_rule_refuses_a_different_key_after_waiting(state: ClusterState) -> None:
    api = FakeApi([api_pod("first"), api_pod("second", memory=2048)])
    ext = extender(state, api)
    assert bind(ext, "default", "first", "uid-first", "n") == ""
    # Echo the first pod as bound and in flight, as the watch would.
    state.upsert_pod(api.pod("first"))
    error = bind(ext, "default", "second", "uid-second", "n")
    assert error.startswith("pod default/first is still being admitted on node n with a 1-GPU container")
    # Served by the device plugin (its phase patch on the API server, echoed by the watch): the second
    # one binds.
    api.pods["first"]["metadata"]["annotations"][KEYS.allocation_phase] = Phase.ALLOCATED.value
    state.upsert_pod(api.pod("first"))
    assert bind(ext, "default", "second", "uid-second", "n") == ""
    assert used(state) == 4096 + 2048


def test_a_bind_waiting_on_the_inflight_rule_goes_on_when_the_other_pod_is_served(
    state: ClusterState,
) -> None:
    api = FakeApi([api_pod("first"), api_pod("second", memory=2048)])
    ext = extender(state, api)
    ext.inflight_wait = timedelta(minutes=10)
    assert bind(ext, "default", "first", "uid-first", "n") == ""
    state.upsert_pod(api.pod("first"))

    async def serve_first_while_second_waits() -> str:
        second = asyncio.create_task(ext.bind("default", "second", "uid-second", "n"))
        await asyncio.sleep(0.05)
        assert not second.done(), "the in-flight rule should hold the second pod"
        served = api.pod("first")
        served["metadata"]["annotations"][KEYS.allocation_phase] = Phase.ALLOCATED.value
        state.upsert_pod(served)
        # Woken by the change, not by the end of its ten minutes.
        return await asyncio.wait_for(second, 30)

    assert asyncio.run(serve_first_while_second_waits()) == ""
    assert used(state) == 4096 + 2048


def test_a_filter_the_inflight_rule_refused_reads_the_node_before_it_answers(state: ClusterState) -> None:
    """kube-scheduler retries an extender-refused pod on its next cluster event, which may be the
    device plugin serving the pod in flight, ahead of the extender's watch: filter reads the node's
    pods and answers from them, or the pod would wait for an unrelated event."""
    api = FakeApi([api_pod("first"), api_pod("second", memory=2048)])
    ext = extender(state, api)
    assert bind(ext, "default", "first", "uid-first", "n") == ""
    state.upsert_pod(api.pod("first"))  # the watch's echo: in flight

    def filtered() -> FilterAnswer:
        return asyncio.run(ext.filter_rechecked(api.pod("second"), ["n"]))

    def rechecks(result: str) -> float:
        value: float = ext.metrics.filter_rechecks.labels(result)._value.get()
        return value

    # Still in flight on the API server too: refused, naming the rule.
    refused = filtered()
    assert refused.passed == [] and refused.failed["n"].startswith(
        "pod default/first is still being admitted"
    )
    assert rechecks("unchanged") == 1
    # Served on the API server; the watch has not shown it.
    api.pods["first"]["metadata"]["annotations"][KEYS.allocation_phase] = Phase.ALLOCATED.value
    assert filtered().passed == ["n"]
    assert rechecks("changed") == 1
    assert state.counted_as("uid-first").phase == Phase.ALLOCATED.value  # type: ignore[union-attr]
    # Counted once per call, rechecked or not.
    assert ext.metrics.pods_filtered.labels("infeasible")._value.get() == 1
    assert ext.metrics.pods_filtered.labels("feasible")._value.get() == 1


def test_a_filter_answers_again_when_the_watch_catches_up_while_it_reads_the_node(
    state: ClusterState,
) -> None:
    """The watch may deliver the served pod while filter's read is under way: the read then changes
    nothing, and the answer made before it is out of date all the same."""
    api = FakeApi([api_pod("first"), api_pod("second", memory=2048)])
    ext = extender(state, api)
    assert bind(ext, "default", "first", "uid-first", "n") == ""
    state.upsert_pod(api.pod("first"))
    api.pods["first"]["metadata"]["annotations"][KEYS.allocation_phase] = Phase.ALLOCATED.value
    listed = api.list

    async def list_as_the_watch_catches_up(
        path: str, field_selector: str = ""
    ) -> tuple[list[JsonObject], str]:
        state.upsert_pod(api.pod("first"))  # the watch's event, handled during the read
        return await listed(path, field_selector)

    api.list = list_as_the_watch_catches_up  # type: ignore[method-assign]
    assert asyncio.run(ext.filter_rechecked(api.pod("second"), ["n"])).passed == ["n"]
    assert ext.metrics.filter_rechecks.labels("changed")._value.get() == 1


def test_a_filter_answers_from_its_own_view_when_the_node_cannot_be_read(state: ClusterState) -> None:
    api = FakeApi([api_pod("first"), api_pod("second", memory=2048)])
    ext = extender(state, api)
    assert bind(ext, "default", "first", "uid-first", "n") == ""
    state.upsert_pod(api.pod("first"))

    async def unreadable(path: str, field_selector: str = "") -> tuple[list[JsonObject], str]:
        raise ApiError(0, "GET /api/v1/pods: ClientConnectorError: connection refused")

    api.list = unreadable  # type: ignore[method-assign]
    answer = asyncio.run(ext.filter_rechecked(api.pod("second"), ["n"]))
    assert answer.passed == [] and "still being admitted" in answer.failed["n"]
    assert ext.metrics.filter_rechecks.labels("failed")._value.get() == 1


def test_reservations_for_pods_that_do_not_exist_are_dropped_at_once(state: ClusterState) -> None:
    """The issue's attack: filters for made-up pods reserved every GPU for 10 s and a real pod was
    refused. Each reservation is checked against the API server and dropped when its pod is not
    there (or names another scheduler, or asks another shape)."""
    four = [
        node_object(f"n{i}", inventory(f"n{i}", "Tesla T4", 15360, count=1, split=4), NOW) for i in range(4)
    ]
    state.replace_nodes(four, NOW)
    real = api_pod("real", memory=15000)
    other = api_pod("other-scheduler", memory=15000, scheduler="default-scheduler")
    api = FakeApi([real, other])
    ext = extender(state, api)
    nodes = [f"n{i}" for i in range(4)]

    async def attack() -> list[str]:
        for i in range(16):
            # Each made-up pod fills one GPU: the first four take every node.
            ext.filter(gpu_pod(f"fake-{i}", uid=f"uid-fake-{i}", memory=15000), nodes)
        ext.filter(api.pod("other-scheduler"), nodes)
        await asyncio.sleep(0.01)  # the checks' reads
        return ext.filter(api.pod("real"), nodes).passed

    assert asyncio.run(attack()) == nodes  # every node free again for the real pod
    reserved = [uid for uid in (f"uid-fake-{i}" for i in range(16)) if state.reservation(uid)]
    assert reserved == []
    assert state.reservation("uid-other-scheduler") is None


def test_unchecked_reservations_are_bounded(state: ClusterState) -> None:
    api = FakeApi([])
    ext = extender(state, api)

    async def flood() -> int:
        for i in range(200):
            ext.filter(gpu_pod(f"fake-{i}", uid=f"uid-fake-{i}", memory=1), ["n"])
        count = ext.reserver.unchecked()
        await asyncio.sleep(0.01)
        return count

    assert asyncio.run(flood()) <= 64
    assert used(state) == 0


@pytest.mark.parametrize(
    ("priority", "annotation", "qos"),
    [
        (None, None, QosClass.STANDARD),
        (1_000_000, None, QosClass.LATENCY_CRITICAL),
        (-10, None, QosClass.BEST_EFFORT),
        (2_000_000_000, QosClass.BEST_EFFORT.value, QosClass.BEST_EFFORT),
        (-10, QosClass.LATENCY_CRITICAL.value, QosClass.BEST_EFFORT),  # granted, not claimed
    ],
)
def test_bind_writes_the_pods_qos_class(
    state: ClusterState, priority: int | None, annotation: str | None, qos: QosClass
) -> None:
    pod = api_pod("p", annotations={KEYS.qos: annotation} if annotation else None)
    if priority is not None:
        pod["spec"]["priority"] = priority
    api = FakeApi([pod])
    ext = extender(state, api)
    ext.filter(api.pod("p"), ["n"])  # the reservation carries the class, and bind confirms it
    assert bind(ext, "default", "p", "uid-p", "n") == ""
    assert parse_allocation(api.pods["p"]["metadata"]["annotations"][KEYS.allocation]).qos == qos
    lowered = [e for e in api.events if e[1] == "QosClassLowered"]
    if annotation is not None and QosClass(annotation) != qos:
        assert lowered == [("p", "QosClassLowered", lowered[0][2], True)]
        assert lowered[0][2].startswith(f"asked for QoS class {annotation}, runs as {qos.value}")
    else:
        assert lowered == []


def test_a_namespace_the_admin_lists_may_claim_latency_critical(state: ClusterState) -> None:
    pod = api_pod("p", annotations={KEYS.qos: QosClass.LATENCY_CRITICAL.value})
    pod["spec"]["priority"] = -10
    api = FakeApi([pod])
    ext = extender(state, api, QosThresholds(latency_critical_namespaces=frozenset({"default"})))
    assert bind(ext, "default", "p", "uid-p", "n") == ""
    allocation = parse_allocation(api.pods["p"]["metadata"]["annotations"][KEYS.allocation])
    assert allocation.qos == QosClass.LATENCY_CRITICAL
    assert api.events == []


def test_thresholds_of_ones_own_decide_the_class(state: ClusterState) -> None:
    pod = api_pod("p")
    pod["spec"]["priority"] = 100
    api = FakeApi([pod])
    ext = extender(state, api, QosThresholds(latency_critical_priority=100))
    assert bind(ext, "default", "p", "uid-p", "n") == ""
    assert (
        parse_allocation(api.pods["p"]["metadata"]["annotations"][KEYS.allocation]).qos
        == QosClass.LATENCY_CRITICAL
    )
