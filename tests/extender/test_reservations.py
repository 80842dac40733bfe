"""Reservations: made at filter, confirmed at bind, expired after their time to live."""

from __future__ import annotations

from datetime import timedelta

import pytest

from extender.podrecords import PodAllocation
from extender.state import ClusterState
from tessera.contract import KEYS, Phase, PodPreferences
from tessera.placement import ContainerShape, PlacementEngine, PodShape, SpeedProfiles, to_allocation
from tests.extender.helpers import inventory, node_object
from tests.extender.statecase import NOW, allocation, one_node_state, pod, record, used


@pytest.fixture
def state() -> ClusterState:
    return one_node_state()


def test_reservations_count_as_in_flight_and_expire(state: ClusterState) -> None:
    state.reservations.reserve(record("a"), NOW)
    assert used(state) == 4096
    assert state.inflight.nodes() == {"n"}
    assert state.inflight.pods("n", NOW, timedelta(minutes=5)).without("other") == {
        "ns/a": ((1, ("GPU-n-0",), ((4096, 30, False),)),)
    }
    state.reservations.expire(NOW + timedelta(seconds=5))
    assert used(state) == 4096
    state.reservations.expire(NOW + timedelta(seconds=11))
    assert used(state) == 0
    assert state.inflight.nodes() == set()


def test_a_bind_decision_replaces_the_reservation(state: ClusterState) -> None:
    state.reservations.reserve(record("a", memory=2048), NOW)
    state.pods.unreserve("a")
    state.pods.assume(record("a"))
    state.reservations.expire(NOW + timedelta(minutes=1))  # not a reservation any more
    assert used(state) == 4096


def test_a_reservation_confirmed_at_bind_becomes_the_decision_without_a_rebuild(state: ClusterState) -> None:
    state.reservations.reserve(record("a"), NOW)
    before = state.engine.nodes["n"]
    later = NOW + timedelta(seconds=1)
    confirmed = state.reservations.confirm("a", "n", Phase.ALLOCATING.value, later)
    assert confirmed is not None
    assert (confirmed.allocation, confirmed.phase, confirmed.bind_time) == (allocation(), "allocating", later)
    assert state.engine.nodes["n"] is before  # same usage: the engine's caches stay
    state.reservations.expire(NOW + timedelta(minutes=1))  # a decision now, not a reservation
    assert used(state) == 4096
    assert state.inflight.pods("n", later, timedelta(minutes=5)).without("x") == {"ns/a": confirmed.keys}
    assert state.reservations.confirm("a", "n", Phase.ALLOCATING.value, later) is None  # only once


def test_no_reservation_to_confirm_elsewhere_or_on_a_node_gone_stale(state: ClusterState) -> None:
    assert state.reservations.confirm("a", "n", Phase.ALLOCATING.value, NOW) is None  # none made
    state.reservations.reserve(record("a"), NOW)
    assert state.reservations.confirm("a", "other", Phase.ALLOCATING.value, NOW) is None
    state.sweep_heartbeats(NOW + timedelta(seconds=61))
    assert state.reservations.confirm("a", "n", Phase.ALLOCATING.value, NOW) is None


def test_a_reservation_from_a_fit_adds_it_as_a_rebuild_would(state: ClusterState) -> None:
    state.pods.upsert(pod("a", bound=True))  # something on the node already
    twin = ClusterState(PlacementEngine(SpeedProfiles()), KEYS, heartbeat_timeout=timedelta(seconds=60))
    twin.replace_nodes([node_object("n", inventory("n", "Tesla T4", 15360), NOW)], NOW)
    twin.replace_pods([pod("a", bound=True)])
    shape = PodShape(containers=(ContainerShape(1, 2048, 20),), preferences=PodPreferences())
    [fit] = state.counted.evaluate(shape, ["n"]).fits
    reserved = PodAllocation("b", "ns", "b", to_allocation(fit.node, fit.placement, ["main"]), None, NOW)
    state.reservations.reserve(reserved, NOW, fit)
    twin.reservations.reserve(reserved, NOW)  # rebuilt from every pod on the node
    assert state.engine.nodes["n"] == twin.engine.nodes["n"]
    assert state.engine.nodes["n"].gpus[0].used_memory_mib == 4096 + 2048
    assert state.inflight.nodes() == {"n"}
    state.pods.unreserve("b")
    assert state.engine.nodes["n"].gpus[0].used_memory_mib == 4096
