"""/bind against a stand-in for the API server (the real one is in test_k8s.py): one write,
preconditions, retries after a conflict, idempotence, nothing counted after a failure, only the leader
binding, the QoS class written."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest

from extender.kube import ApiError
from extender.leader import LeaderLease
from extender.state import ClusterState
from tessera.contract import KEYS, Phase, QosClass, parse_allocation
from tessera.placement import PlacementEngine, QosThresholds, SpeedProfiles
from tests.extender.bindcase import NOW, FakeApi, api_pod, bind, extender, one_gpu_state, used
from tests.extender.helpers import gpu_pod, inventory, node_object


@pytest.fixture
def state() -> ClusterState:
    return one_gpu_state()


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


def test_a_bind_whose_answer_was_lost_still_holds_its_gpu_for_the_in_flight_rule(state: ClusterState) -> None:
    """The API server committed the binding and died before answering (the chaos test: `Server
    disconnected`). The pod is bound and in flight, whatever the extender heard: another key may not
    be bound on its GPU until it is admitted (the device plugin would serve one pod's quotas to the
    other)."""
    api = FakeApi([api_pod("p", memory=1024, cores=10), api_pod("q", memory=2048, cores=30)])
    ext = extender(state, api)
    api.lose_next_answer = True
    assert "Server disconnected" in bind(ext, "default", "p", "uid-p", "n")
    assert api.pods["p"]["spec"]["nodeName"] == "n"
    # The filter's view has p forgotten (its bind failed, its watch not back yet): q is reserved on
    # p's GPU, and bind would take that reservation unless the node's list counts p again.
    assert ext.filter(api.pod("q"), ["n"]).passed == ["n"]
    refused = bind(ext, "default", "q", "uid-q", "n")
    assert "in flight" in refused, refused
    assert "nodeName" not in api.pods["q"]["spec"]


def test_a_pod_found_bound_where_it_was_only_reserved_elsewhere_undoes_the_early_decision() -> None:
    """The chaos test (seed 7): p's binding went through but its answer was lost, so p was forgotten
    and kube-scheduler retried it; meanwhile q was reserved on p's GPU, and p's retry reserved on
    another node. At q's bind the node's list shows p bound on q's GPU with other quotas: q's
    decision, taken from its reservation before the list, must be taken again (p was counted, but
    elsewhere)."""
    state = ClusterState(PlacementEngine(SpeedProfiles()), KEYS, heartbeat_timeout=timedelta(minutes=5))
    state.replace_nodes(
        [node_object(n, inventory(n, "Tesla T4", 15360, count=1, split=4), NOW) for n in ("n", "m")], NOW
    )
    state.replace_pods([])
    api = FakeApi([api_pod("p", memory=1024, cores=10), api_pod("q", memory=2048, cores=30)])
    ext = extender(state, api)
    api.lose_next_answer = True
    assert "Server disconnected" in bind(ext, "default", "p", "uid-p", "n")
    assert ext.filter(api.pod("q"), ["n"]).passed == ["n"]
    # kube-scheduler's retry of p, from its own cache: the pod as it was before the binding.
    unbound = api.pod("p")
    unbound["spec"].pop("nodeName")
    for key in (KEYS.allocation, KEYS.allocation_phase, KEYS.bind_time):
        unbound["metadata"]["annotations"].pop(key)
    assert ext.filter(unbound, ["m"]).passed == ["m"]
    assert state.counts("uid-p")  # reserved, on the other node
    refused = bind(ext, "default", "q", "uid-q", "n")
    assert "in flight" in refused, refused
    assert "nodeName" not in api.pods["q"]["spec"]
