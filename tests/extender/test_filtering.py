"""Filter: a pod the in-flight rule refused everywhere is filtered again once its nodes are read."""

from __future__ import annotations

import asyncio

import pytest

from extender.filtering import FilterAnswer
from extender.kube import ApiError
from extender.state import ClusterState
from tessera.contract import KEYS, JsonObject, Phase
from tests.extender.bindcase import FakeApi, api_pod, bind, extender, one_gpu_state


@pytest.fixture
def state() -> ClusterState:
    return one_gpu_state()


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
