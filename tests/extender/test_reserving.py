"""The reserver: reservations for pods that do not exist, or are not this extender's, do not hold."""

from __future__ import annotations

import asyncio

import pytest

from extender.state import ClusterState
from tests.extender.bindcase import NOW, FakeApi, api_pod, extender, one_gpu_state, used
from tests.extender.helpers import gpu_pod, inventory, node_object


@pytest.fixture
def state() -> ClusterState:
    return one_gpu_state()


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
