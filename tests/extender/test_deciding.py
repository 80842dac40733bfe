"""Bind's in-memory half: the in-flight rule refuses, and a bind waits for the pod in flight."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from extender.deciding import Decider, Refusal
from extender.podrecords import PodAllocation
from extender.shapes import PodShapes
from extender.state import ClusterState
from tessera.contract import KEYS, Phase, parse_pod_request
from tessera.placement import QosThresholds
from tests.extender.bindcase import NOW, FakeApi, api_pod, bind, extender, one_gpu_state, used


@pytest.fixture
def state() -> ClusterState:
    return one_gpu_state()


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
    ext = extender(state, api, inflight_wait=timedelta(minutes=10))
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


def test_a_decision_confirms_the_pods_reservation_or_places_it_anew(state: ClusterState) -> None:
    decider = Decider(
        state,
        PodShapes(False, QosThresholds()),
        inflight_timeout=timedelta(minutes=5),
        inflight_wait=timedelta(0),
    )
    pod = api_pod("p", memory=2048)
    request = parse_pod_request(pod, KEYS)
    placed = decider.decide(pod, request, "n", NOW)
    assert not isinstance(placed, Refusal) and used(state) == 2048
    state.forget("uid-p", placed)
    state.reserve(PodAllocation("uid-p", "default", "p", placed, None, NOW), NOW)
    assert decider.decide(pod, request, "n", NOW) == placed  # the reservation, confirmed
    assert state.reservation("uid-p") is None and used(state) == 2048
    huge = api_pod("q", memory=15361)
    refused = decider.decide(huge, parse_pod_request(huge, KEYS), "n", NOW)
    assert isinstance(refused, Refusal) and refused.reason == "no_fit"
    assert refused.message.startswith("pod default/q no longer fits on node n: ")
