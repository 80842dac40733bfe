"""ClusterState: the parts composed; a Node's change re-counts its node in the placement engine."""

from __future__ import annotations

from datetime import timedelta

import pytest

from extender.state import ClusterState
from tessera.contract import KEYS
from tessera.placement import PlacementEngine, SpeedProfiles
from tests.extender.helpers import inventory, node_object
from tests.extender.statecase import NOW, one_node_state


@pytest.fixture
def state() -> ClusterState:
    return one_node_state()


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


def test_a_relist_of_nodes_drops_the_ones_not_listed_and_marks_them_synced() -> None:
    state = ClusterState(PlacementEngine(SpeedProfiles()), KEYS, heartbeat_timeout=timedelta(seconds=60))
    assert state.unsynced() == ["nodes", "pods"]
    state.replace_nodes(
        [node_object(name, inventory(name, "Tesla T4", 15360), NOW) for name in ("n", "m")], NOW
    )
    assert state.unsynced() == ["pods"] and state.node_count() == 2
    state.replace_nodes([node_object("m", inventory("m", "Tesla T4", 15360), NOW)], NOW)
    assert not state.knows_node("n") and state.node("m") is not None
    state.replace_pods([])
    assert state.unsynced() == []
