"""The pod book: one record per pod (observed, assumed, reserved), what counts on each node, and
the changes binds wait for."""

from __future__ import annotations

import pytest

from extender.state import ClusterState
from tests.extender.statecase import NOW, allocation, one_node_state, pod, record, used


@pytest.fixture
def state() -> ClusterState:
    return one_node_state()


def test_bound_pods_count_unbound_and_finished_ones_do_not(state: ClusterState) -> None:
    state.pods.upsert(pod("a", bound=True))
    assert used(state) == 4096
    state.pods.upsert(pod("b", bound=False))  # a bind that died half-way holds nothing
    assert used(state) == 4096
    state.pods.upsert(pod("a", bound=True, status="Succeeded"))
    assert used(state) == 0


def test_an_assumption_counts_until_the_watch_shows_the_pod_bound(state: ClusterState) -> None:
    state.pods.assume(record("a"))
    assert used(state) == 4096
    state.pods.upsert(pod("a", bound=False))  # an older version of the pod: the assumption stays
    assert used(state) == 4096
    state.pods.upsert(pod("a", bound=True))
    state.pods.delete("a")
    assert used(state) == 0


def test_a_read_applied_after_the_watch_showed_the_pod_gone_does_not_bring_it_back(
    state: ClusterState,
) -> None:
    """A list (bind's and filter's catch-up) served before a deletion, applied after the watch's
    DELETED event: the pod would count, in flight, with no event ever to remove it."""
    listed = pod("a", bound=True, version=5)
    state.pods.upsert(listed)
    state.pods.delete("a")  # the watch
    assert not state.pods.upsert_read(listed)
    assert used(state) == 0 and state.inflight.nodes() == set()
    state.pods.upsert(listed)  # nor a late event
    assert used(state) == 0


def test_a_read_older_than_the_watch_does_not_move_the_pod_back(state: ClusterState) -> None:
    state.pods.upsert(pod("a", bound=True, phase="allocated", version=7))
    assert not state.pods.upsert_read(pod("a", bound=True, phase="allocating", version=6))
    assert state.inflight.nodes() == set()
    assert state.pods.upsert_read(pod("a", bound=True, phase="allocated", memory=2048, version=9))
    assert used(state) == 2048
    assert state.pods.upsert_read(pod("b", bound=True, version=3))  # new to the state
    assert used(state) == 2048 + 4096


def test_a_relist_keeps_binds_it_may_predate_and_drops_the_rest(state: ClusterState) -> None:
    """Pods missing from a relist are gone, but for binds answered after the list was requested (or
    not yet answered), which it could not show."""
    state.pods.upsert(pod("gone", bound=True))
    state.pods.assume(record("done", memory=1024))
    state.pods.bind_answered("done")
    listed = state.pods.mark()
    state.pods.assume(record("binding", memory=2048))  # its bind not answered yet
    state.pods.assume(record("answered", memory=512))
    state.pods.bind_answered("answered")
    state.reservations.reserve(record("reserved", memory=256), NOW)
    state.pods.replace([], listed)
    assert used(state) == 2048 + 512
    assert state.pods.upsert_read(pod("reserved", bound=True, memory=256))  # reservations are not gone
    assert not state.pods.upsert_read(pod("gone", bound=True)) and not state.pods.upsert_read(
        pod("done", bound=True)
    )
    state.pods.replace([], state.pods.mark())
    assert used(state) == 2048  # only the bind on its way


def test_forget_undoes_an_assumption(state: ClusterState) -> None:
    state.pods.assume(record("a"))
    state.pods.forget("a", allocation())
    assert used(state) == 0


def test_the_watch_echoing_an_assumption_changes_no_usage(state: ClusterState) -> None:
    state.pods.assume(record("a"))
    before = state.engine.nodes["n"]
    state.pods.upsert(pod("a", bound=True))
    assert state.engine.nodes["n"] is before
    assert state.pods.pods_on("n") == [record("a")]
    state.pods.upsert(pod("a", bound=True, phase="allocated"))  # served: out of flight
    assert state.inflight.nodes() == set()
    state.pods.delete("a")
    assert used(state) == 0


def test_every_counted_change_is_told_and_the_echo_of_a_bind_is_not(state: ClusterState) -> None:
    changes = state.changes.count
    state.pods.assume(record("a"))
    assert state.changes.count == changes + 1
    state.pods.upsert(pod("a", bound=True))  # the watch echoing the bind: nothing that counts
    state.pods.upsert(pod("a", bound=True))  # nor the same again
    assert state.changes.count == changes + 1
    state.pods.upsert(pod("a", bound=True, phase="allocated"))
    assert state.changes.count == changes + 2


def test_the_pods_kube_scheduler_could_evict_are_bound_and_not_being_deleted(state: ClusterState) -> None:
    state.pods.upsert(pod("a", bound=True))
    leaving = pod("b", bound=True)
    leaving["metadata"]["deletionTimestamp"] = "2026-01-01T12:00:00Z"
    state.pods.upsert(leaving)
    state.reservations.reserve(record("c", memory=1024), NOW)
    assert {p.uid for p in state.pods.pods_on("n")} == {"a", "b", "c"}
    assert [p.uid for p in state.pods.evictable_on("n")] == ["a"]
