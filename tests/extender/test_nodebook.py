"""The node book: inventory, heartbeat and staleness from a Node's annotations, without the engine."""

from __future__ import annotations

from datetime import timedelta

from extender.nodebook import NodeBook
from tessera.contract import KEYS
from tests.extender.helpers import inventory, node_object
from tests.extender.statecase import NOW, allocation, record


def book() -> NodeBook:
    return NodeBook(KEYS, heartbeat_timeout=timedelta(seconds=60), usage_rule=None)


def test_a_node_with_an_inventory_is_kept_and_one_without_leaves() -> None:
    nodes = book()
    assert nodes.upsert(node_object("n", inventory("n", "Tesla T4", 15360), NOW), NOW) == "n"
    assert "n" in nodes and nodes.names() == {"n"}
    assert nodes.upsert(node_object("n", None, NOW), NOW) == "n"
    assert "n" not in nodes
    assert nodes.build("n", [], [], lambda _: False) is None  # not in the book: nothing to build


def test_a_node_is_built_with_the_allocations_counted_on_it() -> None:
    nodes = book()
    nodes.upsert(node_object("n", inventory("n", "Tesla T4", 15360), NOW), NOW)
    built = nodes.build("n", [record("a")], [allocation(2048)], lambda _: True)
    assert built is not None and built.schedulable
    assert built.gpus[0].used_memory_mib == 2048  # the allocation given, not the pod's own


def test_the_sweep_names_the_nodes_whose_heartbeat_went_stale_or_came_back() -> None:
    nodes = book()
    nodes.upsert(node_object("n", inventory("n", "Tesla T4", 15360), NOW), NOW)
    nodes.upsert(node_object("m", inventory("m", "Tesla T4", 15360), NOW + timedelta(seconds=30)), NOW)
    assert nodes.sweep(NOW + timedelta(seconds=30)) == []
    assert nodes.sweep(NOW + timedelta(seconds=61)) == ["n"]
    assert nodes.sweep(NOW + timedelta(seconds=62)) == []  # still stale: no change
    built = nodes.build("n", [], [], lambda _: False)
    assert built is not None and not built.schedulable
    assert built.unschedulable_reason == "Tessera device plugin heartbeat is 61 s old (timeout 60 s)"


def test_a_missing_or_unreadable_heartbeat_is_the_reason() -> None:
    nodes = book()
    nodes.upsert(node_object("n", inventory("n", "Tesla T4", 15360), None), NOW)
    built = nodes.build("n", [], [], lambda _: False)
    assert built is not None
    assert (
        built.unschedulable_reason
        == f"no heartbeat from the Tessera device plugin (annotation {KEYS.node_heartbeat}): "
        "not running, stopping, or not yet registered with the kubelet"
    )
    broken = node_object("n", inventory("n", "Tesla T4", 15360), NOW)
    broken["metadata"]["annotations"][KEYS.node_heartbeat] = "yesterday"
    nodes.upsert(broken, NOW)
    built = nodes.build("n", [], [], lambda _: False)
    assert built is not None and built.unschedulable_reason.startswith(f"annotation {KEYS.node_heartbeat}")
