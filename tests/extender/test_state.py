"""ClusterState: what counts against a GPU, from Node and Pod objects and from the extender's own
decisions."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from extender.podrecords import PodAllocation
from extender.state import ClusterState
from tessera.contract import (
    KEYS,
    Allocation,
    ContainerAllocation,
    GpuGrant,
    Phase,
    PodPreferences,
    dump_allocation,
    format_time,
)
from tessera.placement import ContainerShape, PlacementEngine, PodShape, SpeedProfiles, to_allocation
from tests.extender.helpers import inventory, node_object

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


@pytest.fixture
def state() -> ClusterState:
    s = ClusterState(PlacementEngine(SpeedProfiles()), KEYS, heartbeat_timeout=timedelta(seconds=60))
    s.replace_nodes([node_object("n", inventory("n", "Tesla T4", 15360), NOW)], NOW)
    s.replace_pods([])
    return s


def allocation(memory: int = 4096, gpu: int = 0) -> Allocation:
    return Allocation(
        node="n",
        containers=(
            ContainerAllocation(
                name="main", gpus=(GpuGrant(uuid=f"GPU-n-{gpu}", memory_quota_mib=memory, cores=30),)
            ),
        ),
    )


def pod(
    uid: str,
    *,
    bound: bool,
    phase: str = "allocating",
    status: str = "Pending",
    memory: int = 4096,
    version: int = 1,
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": uid,
            "namespace": "ns",
            "uid": uid,
            "resourceVersion": str(version),
            "annotations": {
                KEYS.allocation: dump_allocation(allocation(memory)),
                KEYS.allocation_phase: phase,
                KEYS.bind_time: format_time(NOW),
            },
        },
        "spec": {"nodeName": "n"} if bound else {},
        "status": {"phase": status},
    }


def used(state: ClusterState) -> int:
    return state.engine.nodes["n"].gpus[0].used_memory_mib


def record(uid: str, memory: int = 4096) -> PodAllocation:
    return PodAllocation(uid, "ns", uid, allocation(memory), Phase.ALLOCATING.value, NOW)


def test_bound_pods_count_unbound_and_finished_ones_do_not(state: ClusterState) -> None:
    state.upsert_pod(pod("a", bound=True))
    assert used(state) == 4096
    state.upsert_pod(pod("b", bound=False))  # a bind that died half-way holds nothing
    assert used(state) == 4096
    state.upsert_pod(pod("a", bound=True, status="Succeeded"))
    assert used(state) == 0


def test_an_assumption_counts_until_the_watch_shows_the_pod_bound(state: ClusterState) -> None:
    state.assume(record("a"))
    assert used(state) == 4096
    state.upsert_pod(pod("a", bound=False))  # an older version of the pod: the assumption stays
    assert used(state) == 4096
    state.upsert_pod(pod("a", bound=True))
    state.delete_pod("a")
    assert used(state) == 0


def test_a_read_applied_after_the_watch_showed_the_pod_gone_does_not_bring_it_back(
    state: ClusterState,
) -> None:
    """A list (bind's and filter's catch-up) served before a deletion, applied after the watch's
    DELETED event: the pod would count, in flight, with no event ever to remove it."""
    listed = pod("a", bound=True, version=5)
    state.upsert_pod(listed)
    state.delete_pod("a")  # the watch
    assert not state.upsert_read_pod(listed)
    assert used(state) == 0 and state.nodes_with_inflight() == set()
    state.upsert_pod(listed)  # nor a late event
    assert used(state) == 0


def test_a_read_older_than_the_watch_does_not_move_the_pod_back(state: ClusterState) -> None:
    state.upsert_pod(pod("a", bound=True, phase="allocated", version=7))
    assert not state.upsert_read_pod(pod("a", bound=True, phase="allocating", version=6))
    assert state.nodes_with_inflight() == set()
    assert state.upsert_read_pod(pod("a", bound=True, phase="allocated", memory=2048, version=9))
    assert used(state) == 2048
    assert state.upsert_read_pod(pod("b", bound=True, version=3))  # new to the state
    assert used(state) == 2048 + 4096


def test_a_relist_keeps_binds_it_may_predate_and_drops_the_rest(state: ClusterState) -> None:
    """Pods missing from a relist are gone, but for binds answered after the list was requested (or
    not yet answered), which it could not show."""
    state.upsert_pod(pod("gone", bound=True))
    state.assume(record("done", memory=1024))
    state.bind_answered("done")
    listed = state.mark()
    state.assume(record("binding", memory=2048))  # its bind not answered yet
    state.assume(record("answered", memory=512))
    state.bind_answered("answered")
    state.reserve(record("reserved", memory=256), NOW)
    state.replace_pods([], listed)
    assert used(state) == 2048 + 512
    assert state.upsert_read_pod(pod("reserved", bound=True, memory=256))  # reservations are not gone
    assert not state.upsert_read_pod(pod("gone", bound=True)) and not state.upsert_read_pod(
        pod("done", bound=True)
    )
    state.replace_pods([], state.mark())
    assert used(state) == 2048  # only the bind on its way


def test_forget_undoes_an_assumption(state: ClusterState) -> None:
    state.assume(record("a"))
    state.forget("a", allocation())
    assert used(state) == 0


def test_reservations_count_as_in_flight_and_expire(state: ClusterState) -> None:
    state.reserve(record("a"), NOW)
    assert used(state) == 4096
    assert state.nodes_with_inflight() == {"n"}
    assert state.inflight_pods("n", NOW, timedelta(minutes=5)).without("other") == {
        "ns/a": ((1, ("GPU-n-0",), ((4096, 30, False),)),)
    }
    state.expire_reservations(NOW + timedelta(seconds=5))
    assert used(state) == 4096
    state.expire_reservations(NOW + timedelta(seconds=11))
    assert used(state) == 0
    assert state.nodes_with_inflight() == set()


def test_the_pods_in_flight_on_a_node_are_one_object_until_they_change(state: ClusterState) -> None:
    timeout = timedelta(minutes=5)
    state.assume(record("a"))
    first = state.inflight_pods("n", NOW, timeout)
    assert first.keys == {"ns/a": ((1, ("GPU-n-0",), ((4096, 30, False),)),)}
    assert first.without("a") == {}
    assert first.without("other") is first.keys
    # Unchanged: the same object (filter's in-flight answers are remembered by it).
    assert state.inflight_pods("n", NOW + timedelta(minutes=1), timeout) is first
    state.assume(
        PodAllocation("b", "ns", "b", allocation(2048), Phase.ALLOCATING.value, NOW + timedelta(minutes=2))
    )
    second = state.inflight_pods("n", NOW + timedelta(minutes=2), timeout)
    assert second is not first
    assert set(second.keys) == {"ns/a", "ns/b"}
    # a's bind times out: b alone, in a new object.
    third = state.inflight_pods("n", NOW + timedelta(minutes=6), timeout)
    assert set(third.keys) == {"ns/b"}
    assert state.inflight_pods("n", NOW + timedelta(minutes=6), timeout) is third


def test_a_bind_decision_replaces_the_reservation(state: ClusterState) -> None:
    state.reserve(record("a", memory=2048), NOW)
    state.unreserve("a")
    state.assume(record("a"))
    state.expire_reservations(NOW + timedelta(minutes=1))  # not a reservation any more
    assert used(state) == 4096


def test_inflight_ignores_old_binds_and_served_pods(state: ClusterState) -> None:
    state.upsert_pod(pod("a", bound=True))
    assert state.inflight_pods("n", NOW + timedelta(minutes=6), timedelta(minutes=5)).without("x") == {}
    state.upsert_pod(pod("a", bound=True, phase="allocated"))
    assert state.nodes_with_inflight() == set()


def test_stale_heartbeat_makes_the_node_unschedulable_and_back(state: ClusterState) -> None:
    assert state.sweep_heartbeats(NOW + timedelta(seconds=61)) == ["n"]
    node = state.engine.nodes["n"]
    assert not node.schedulable
    assert node.unschedulable_reason == "Tessera device plugin heartbeat is 61 s old (timeout 60 s)"
    state.upsert_node(
        node_object("n", inventory("n", "Tesla T4", 15360), NOW + timedelta(seconds=61)),
        NOW + timedelta(seconds=61),
    )
    assert state.engine.nodes["n"].schedulable


def test_unreadable_inventory_is_a_reason_and_no_inventory_is_no_node(state: ClusterState) -> None:
    broken = node_object("n", None, NOW)
    broken["metadata"]["annotations"][KEYS.node_gpus] = "[{}]"
    state.upsert_node(broken, NOW)
    assert state.engine.nodes["n"].unschedulable_reason.startswith(
        f"node 'n': annotation {KEYS.node_gpus}: 0.uuid"
    )
    state.upsert_node(node_object("n", None, NOW), NOW)
    assert "n" not in state.engine.nodes


def test_a_reservation_confirmed_at_bind_becomes_the_decision_without_a_rebuild(state: ClusterState) -> None:
    state.reserve(record("a"), NOW)
    before = state.engine.nodes["n"]
    later = NOW + timedelta(seconds=1)
    confirmed = state.confirm_reservation("a", "n", Phase.ALLOCATING.value, later)
    assert confirmed is not None
    assert (confirmed.allocation, confirmed.phase, confirmed.bind_time) == (allocation(), "allocating", later)
    assert state.engine.nodes["n"] is before  # same usage: the engine's caches stay
    state.expire_reservations(NOW + timedelta(minutes=1))  # a decision now, not a reservation
    assert used(state) == 4096
    assert state.inflight_pods("n", later, timedelta(minutes=5)).without("x") == {"ns/a": confirmed.keys}
    assert state.confirm_reservation("a", "n", Phase.ALLOCATING.value, later) is None  # only once


def test_no_reservation_to_confirm_elsewhere_or_on_a_node_gone_stale(state: ClusterState) -> None:
    assert state.confirm_reservation("a", "n", Phase.ALLOCATING.value, NOW) is None  # none made
    state.reserve(record("a"), NOW)
    assert state.confirm_reservation("a", "other", Phase.ALLOCATING.value, NOW) is None
    state.sweep_heartbeats(NOW + timedelta(seconds=61))
    assert state.confirm_reservation("a", "n", Phase.ALLOCATING.value, NOW) is None


def test_the_watch_echoing_an_assumption_changes_no_usage(state: ClusterState) -> None:
    state.assume(record("a"))
    before = state.engine.nodes["n"]
    state.upsert_pod(pod("a", bound=True))
    assert state.engine.nodes["n"] is before
    assert state.pods_on("n") == [record("a")]
    state.upsert_pod(pod("a", bound=True, phase="allocated"))  # served: out of flight
    assert state.nodes_with_inflight() == set()
    state.delete_pod("a")
    assert used(state) == 0


def test_a_reservation_from_a_fit_adds_it_as_a_rebuild_would(state: ClusterState) -> None:
    state.upsert_pod(pod("a", bound=True))  # something on the node already
    twin = ClusterState(PlacementEngine(SpeedProfiles()), KEYS, heartbeat_timeout=timedelta(seconds=60))
    twin.replace_nodes([node_object("n", inventory("n", "Tesla T4", 15360), NOW)], NOW)
    twin.replace_pods([pod("a", bound=True)])
    shape = PodShape(containers=(ContainerShape(1, 2048, 20),), preferences=PodPreferences())
    [fit] = state.engine.evaluate(shape, ["n"]).fits
    reserved = PodAllocation("b", "ns", "b", to_allocation(fit.node, fit.placement, ["main"]), None, NOW)
    state.reserve(reserved, NOW, fit)
    twin.reserve(reserved, NOW)  # rebuilt from every pod on the node
    assert state.engine.nodes["n"] == twin.engine.nodes["n"]
    assert state.engine.nodes["n"].gpus[0].used_memory_mib == 4096 + 2048
    assert state.nodes_with_inflight() == {"n"}
    state.unreserve("b")
    assert state.engine.nodes["n"].gpus[0].used_memory_mib == 4096


def test_the_inflight_rule_answer_is_kept_until_the_pods_in_flight_change(state: ClusterState) -> None:
    state.assume(record("a"))  # in flight: GPU 0, 4096 MiB, 30%
    other = PodShape((ContainerShape(1, 8192, 30),))  # other quotas: may not be in flight with it
    timeout = timedelta(minutes=5)
    evaluation = state.evaluate(other, ["n"])
    [fit] = evaluation.fits
    refused = state.keeping_inflight_rule(fit, other, evaluation.policy, uid="b", now=NOW, timeout=timeout)
    assert isinstance(refused, str)
    assert refused.startswith("pod ns/a is still being admitted on node n")
    again = state.keeping_inflight_rule(fit, other, evaluation.policy, uid="b", now=NOW, timeout=timeout)
    assert again is refused  # remembered
    state.upsert_pod(pod("a", bound=True, phase="allocated"))  # served: out of flight
    [fit] = state.evaluate(other, ["n"]).fits
    assert (
        state.keeping_inflight_rule(fit, other, evaluation.policy, uid="b", now=NOW, timeout=timeout) is fit
    )
