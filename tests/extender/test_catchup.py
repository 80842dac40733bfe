"""Catching up: a node's pods as the API server lists them, into the state; whether any was new."""

from __future__ import annotations

import asyncio

from extender.catchup import CatchUp
from tessera.contract import JsonObject
from tests.extender import statecase
from tests.extender.bindcase import FakeApi, one_gpu_state, used


def test_a_listed_pod_new_to_the_state_is_counted_and_said_new() -> None:
    state = one_gpu_state()
    api = FakeApi([statecase.pod("a", bound=True), statecase.pod("b", bound=False)])
    catch_up = CatchUp(state, api)  # type: ignore[arg-type]
    listed = asyncio.run(catch_up.node_pods("n"))
    assert [p["metadata"]["name"] for p in listed] == ["a"]  # only the pods bound there
    assert not catch_up.apply([])
    assert catch_up.apply(listed)
    assert used(state) == 4096
    assert not catch_up.apply(listed)  # known now: nothing new


def test_a_node_the_extender_does_not_know_is_not_listed() -> None:
    class NoList(FakeApi):
        async def list(self, path: str, field_selector: str = "") -> tuple[list[JsonObject], str]:
            raise AssertionError("listed an unknown node's pods")

    assert asyncio.run(CatchUp(one_gpu_state(), NoList([])).node_pods("made-up")) == []  # type: ignore[arg-type]
