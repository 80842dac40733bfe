"""The in-flight book: each node's pods in flight, and the in-flight rule's answers there."""

from __future__ import annotations

from datetime import timedelta

import pytest

from extender.podrecords import PodAllocation
from extender.state import ClusterState
from tessera.contract import Phase
from tessera.placement import ContainerShape, PodShape
from tests.extender.statecase import NOW, allocation, one_node_state, pod, record


@pytest.fixture
def state() -> ClusterState:
    return one_node_state()


def test_the_pods_in_flight_on_a_node_are_one_object_until_they_change(state: ClusterState) -> None:
    timeout = timedelta(minutes=5)
    state.pods.assume(record("a"))
    first = state.inflight.pods("n", NOW, timeout)
    assert first.keys == {"ns/a": ((1, ("GPU-n-0",), ((4096, 30, False),)),)}
    assert first.without("a") == {}
    assert first.without("other") is first.keys
    # Unchanged: the same object (filter's in-flight answers are remembered by it).
    assert state.inflight.pods("n", NOW + timedelta(minutes=1), timeout) is first
    state.pods.assume(
        PodAllocation("b", "ns", "b", allocation(2048), Phase.ALLOCATING.value, NOW + timedelta(minutes=2))
    )
    second = state.inflight.pods("n", NOW + timedelta(minutes=2), timeout)
    assert second is not first
    assert set(second.keys) == {"ns/a", "ns/b"}
    # a's bind times out: b alone, in a new object.
    third = state.inflight.pods("n", NOW + timedelta(minutes=6), timeout)
    assert set(third.keys) == {"ns/b"}
    assert state.inflight.pods("n", NOW + timedelta(minutes=6), timeout) is third


def test_inflight_ignores_old_binds_and_served_pods(state: ClusterState) -> None:
    state.pods.upsert(pod("a", bound=True))
    assert state.inflight.pods("n", NOW + timedelta(minutes=6), timedelta(minutes=5)).without("x") == {}
    state.pods.upsert(pod("a", bound=True, phase="allocated"))
    assert state.inflight.nodes() == set()


def test_the_inflight_rule_answer_is_kept_until_the_pods_in_flight_change(state: ClusterState) -> None:
    state.pods.assume(record("a"))  # in flight: GPU 0, 4096 MiB, 30%
    other = PodShape((ContainerShape(1, 8192, 30),))  # other quotas: may not be in flight with it
    timeout = timedelta(minutes=5)
    evaluation = state.counted.evaluate(other, ["n"])
    [fit] = evaluation.fits
    refused = state.inflight.keeping_rule(fit, other, evaluation.policy, uid="b", now=NOW, timeout=timeout)
    assert isinstance(refused, str)
    assert refused.startswith("pod ns/a is still being admitted on node n")
    again = state.inflight.keeping_rule(fit, other, evaluation.policy, uid="b", now=NOW, timeout=timeout)
    assert again is refused  # remembered
    state.pods.upsert(pod("a", bound=True, phase="allocated"))  # served: out of flight
    [fit] = state.counted.evaluate(other, ["n"]).fits
    assert (
        state.inflight.keeping_rule(fit, other, evaluation.policy, uid="b", now=NOW, timeout=timeout) is fit
    )
