"""The counted nodes: the placement engine's nodes as the books make them, and the verbs' questions."""

from __future__ import annotations

from datetime import timedelta

from extender.countednodes import CountedNodes
from extender.nodebook import NodeBook
from tessera.contract import KEYS
from tessera.placement import ContainerShape, PlacementEngine, PodShape, SpeedProfiles
from tessera.placement.engine import UNKNOWN_NODE
from tests.extender.helpers import inventory, node_object
from tests.extender.statecase import NOW, allocation, record


def counted_nodes(*names: str) -> CountedNodes:
    nodes = NodeBook(KEYS, heartbeat_timeout=timedelta(seconds=60), usage_rule=None)
    counted = CountedNodes(PlacementEngine(SpeedProfiles()), nodes)
    for name in names:
        nodes.upsert(node_object(name, inventory(name, "Tesla T4", 15360), NOW), NOW)
        counted.rebuild(name, [], [], lambda _: False)
    return counted


def test_a_rebuild_sets_the_node_in_the_engine_and_one_unknown_to_the_book_is_left_out() -> None:
    counted = counted_nodes("n")
    counted.rebuild("n", [record("a")], [allocation(2048)], lambda _: True)
    node = counted.node("n")
    assert node is not None and node.gpus[0].used_memory_mib == 2048
    counted.rebuild("m", [], [], lambda _: False)
    assert not counted.knows("m") and counted.node_count() == 1
    counted.remove("n")
    assert counted.node("n") is None and counted.node_count() == 0


def test_candidates_keep_each_known_node_once_and_a_few_unknown_names() -> None:
    counted = counted_nodes("a", "b")
    assert counted.candidates(["x", "a"], unknown_kept=0) == ["x", "a"]  # no more names than nodes
    assert counted.candidates(["x", "a", "y", "a", "z", "b"], unknown_kept=1) == ["x", "a", "b"]


def test_victims_on_an_unknown_node_are_refused_with_the_reason() -> None:
    counted = counted_nodes("n")
    answer = counted.choose_victims(
        "m", [], PodShape((ContainerShape(1, 1024, 10),)), 0, budgets=[], max_sets=10
    )
    assert answer == UNKNOWN_NODE
