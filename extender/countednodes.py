"""The counted nodes: the placement engine's nodes, each built from its Node record (the node book)
and the pods counted on it (the pod book), and the verbs' questions to the engine.

The engine is owned here: every other part changes it through :meth:`CountedNodes.rebuild`,
:meth:`CountedNodes.add` and :meth:`CountedNodes.remove`, and the verbs ask it through
:meth:`CountedNodes.evaluate`, :meth:`CountedNodes.choose_victims` and :meth:`CountedNodes.placed`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from extender.budgets import Budget, covering
from extender.nodebook import NodeBook
from extender.podrecords import PodAllocation
from tessera.contract import Allocation
from tessera.placement import (
    Evaluation,
    NodeFit,
    NodeState,
    PlacementEngine,
    PodShape,
    Preemption,
    Victim,
    apply,
    choose_victims,
    placement_of,
)
from tessera.placement.engine import UNKNOWN_NODE


class CountedNodes:
    def __init__(self, engine: PlacementEngine, nodes: NodeBook) -> None:
        self.engine = engine
        self.nodes = nodes

    # ----------------------------------------------------------------------------------------------
    # Changes

    def rebuild(
        self,
        name: str,
        pods: Sequence[PodAllocation],
        allocations: Sequence[Allocation],
        in_flight: Callable[[PodAllocation], bool],
    ) -> None:
        """Node ``name`` with ``pods`` counted on it at ``allocations`` (see NodeBook.build); a node
        not in the node book is left as it is (removed with its record)."""
        state = self.nodes.build(name, pods, allocations, in_flight)
        if state is not None:
            self.engine.set_node(state)

    def add(self, fit: NodeFit) -> None:
        """Count ``fit``'s placement on its node, still as the fit saw it: what rebuilding the node
        from all its pods gives too, at a fraction of the cost (a reservation does this on every
        filter's path)."""
        self.engine.set_node(apply(fit.node, fit.placement))

    def remove(self, name: str) -> None:
        self.engine.remove_node(name)

    # ----------------------------------------------------------------------------------------------
    # What the verbs ask

    def node_count(self) -> int:
        """Nodes with a GPU inventory (readable or not)."""
        return len(self.engine.nodes)

    def knows(self, name: str) -> bool:
        return name in self.engine.nodes

    def node(self, name: str) -> NodeState | None:
        """The node as placement sees it now (every pod counted on it), if it is known."""
        return self.engine.nodes.get(name)

    def candidates(self, names: Sequence[str], unknown_kept: int) -> Sequence[str]:
        """``names`` to evaluate: all of them when they cannot all be distinct known nodes' (no more
        names than nodes: kube-scheduler's lists, checked for free); else each known node once and
        the first ``unknown_kept`` unknown names (answered "unknown node"), the rest left out of the
        answer, which rejects them as surely. A list of a million made-up names costs one pass."""
        nodes = self.engine.nodes
        if len(names) <= len(nodes):
            return names
        kept: list[str] = []
        unknown = 0
        for name in dict.fromkeys(names):
            if name in nodes:
                kept.append(name)
            elif unknown < unknown_kept:
                unknown += 1
                kept.append(name)
        return kept

    def evaluate(self, shape: PodShape, names: Iterable[str]) -> Evaluation:
        """The outcome of ``shape`` on the nodes ``names``, in their order."""
        return self.engine.evaluate(shape, names)

    def choose_victims(
        self,
        name: str,
        evictable: Iterable[PodAllocation],
        shape: PodShape,
        priority: int,
        *,
        budgets: Sequence[Budget],
        max_sets: int,
    ) -> Preemption | str:
        """The pods among ``evictable`` (node ``name``'s) whose eviction makes a pod of ``shape`` and
        ``priority`` fit there (:func:`tessera.placement.choose_victims`), weighing at most
        ``max_sets`` sets; or why no eviction can."""
        node = self.engine.nodes.get(name)
        if node is None:
            return UNKNOWN_NODE
        candidates = []
        for pod in evictable:
            try:
                placement = placement_of(node, pod.allocation)
            except ValueError:
                continue  # it names a GPU gone from the inventory: not one to weigh
            budgets_covering = covering(budgets, pod.namespace, pod.name, dict(pod.labels))
            candidates.append(Victim(pod.uid, pod.priority, placement, budgets_covering, pod.bind_time))
        return choose_victims(
            node,
            shape,
            priority,
            candidates,
            [budget.disruptions_allowed for budget in budgets],
            profiles=self.engine.profiles,
            policy=self.engine.policy_for(shape),
            context=self.engine.context,
            max_sets=max_sets,
        )

    def placed(self, shape: PodShape) -> None:
        """A pod of ``shape`` was bound (its allocation already counts: it was assumed first)."""
        self.engine.commit(shape)

    def oversubscribed_gpus(self) -> int:
        """GPUs holding at least one grant placed against measured use (a metric)."""
        return sum(1 for node in self.engine.nodes.values() for gpu in node.gpus if gpu.borrowed_mib > 0)
