"""Pod changes: a waiting bind wakes on the next change of pods, or at its timeout."""

from __future__ import annotations

import asyncio

import pytest

from extender.podchanges import PodChanges
from extender.state import ClusterState
from tests.extender.statecase import one_node_state, record


@pytest.fixture
def state() -> ClusterState:
    return one_node_state()


def test_a_waiting_bind_wakes_on_the_next_change_or_its_timeout(state: ClusterState) -> None:
    async def scenario() -> None:
        waiting = asyncio.create_task(state.changes.wait(5.0))
        await asyncio.sleep(0)
        state.pods.assume(record("a"))
        async with asyncio.timeout(1.0):
            await waiting
        await PodChanges().wait(0.01)  # nobody changes anything: back after the timeout

    asyncio.run(scenario())
