"""What the extender knows about the cluster, built only from Node and Pod objects (dicts), and its own
decisions: the parts, composed, behind the one object the verbs, the watches and the resizer share.

* :class:`NodeBook` (``nodebook.py``): each Node's inventory, heartbeat (staleness), measured use.
* :class:`PodBook` (``podbook.py``): one record per pod (observed, assumed, reserved), the pods
  counted on each node, live resizes being written.
* :class:`Reservations` (``reservations.py``): made at filter, confirmed at bind, expired.
* :class:`InflightBook` (``inflightbook.py``): each node's pods in flight, the in-flight rule's
  answers there.
* :class:`CountedNodes` (``countednodes.py``): the placement engine's nodes, rebuilt from the books;
  the verbs' questions to the engine.
* :class:`PodChanges` (``podchanges.py``): how many times pods changed; binds waiting for the next.

Not thread-safe, by design, and no part takes a lock: the extender's event loop owns the state
(watches, the heartbeat sweep and the HTTP handlers are all tasks on that one loop), and no method
awaits, so each call's changes across the parts are whole before any other task runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from datetime import datetime, timedelta

from extender.budgets import Budget
from extender.countednodes import CountedNodes
from extender.inflightbook import InflightBook, InflightPods
from extender.nodebook import NodeBook
from extender.podbook import PodBook
from extender.podchanges import PodChanges
from extender.podrecords import PodAllocation
from extender.reservations import Reservations
from tessera.contract import Allocation, ContractKeys, JsonObject
from tessera.placement import (
    Evaluation,
    NodeFit,
    NodeState,
    PlacementEngine,
    PlacementPolicy,
    PodShape,
    Preemption,
    UsageRule,
)


class ClusterState:
    def __init__(
        self,
        engine: PlacementEngine,
        keys: ContractKeys,
        heartbeat_timeout: timedelta,
        reservation_ttl: timedelta = timedelta(seconds=10),
        usage_rule: UsageRule | None = None,
    ) -> None:
        """``usage_rule``: read the nodes' measured GPU use and trust it this far (None: never place
        against measured use)."""
        self.engine = engine
        self.usage_rule = usage_rule
        self.nodes = NodeBook(keys, heartbeat_timeout, usage_rule)
        self.counted = CountedNodes(engine, self.nodes)
        self.inflight = InflightBook(engine)
        self.changes = PodChanges()
        self.pods = PodBook(keys, self.counted, self.inflight, self.changes)
        self.reservations = Reservations(self.pods, self.counted, self.inflight, reservation_ttl)

    def unsynced(self) -> list[str]:
        """The caches not yet filled by a first list: "nodes", "pods"."""
        return [what for what, done in (("nodes", self.nodes.synced), ("pods", self.pods.synced)) if not done]

    # ----------------------------------------------------------------------------------------------
    # Nodes: the node book's change re-counts the node

    def upsert_node(self, node: JsonObject, now: datetime) -> None:
        name = self.nodes.upsert(node, now)
        if name in self.nodes:
            self.pods.recount(name)
        else:
            self.counted.remove(name)

    def delete_node(self, name: str) -> None:
        self.nodes.remove(name)
        self.counted.remove(name)

    def replace_nodes(self, nodes: Iterable[JsonObject], now: datetime) -> None:
        """After a (re)list: exactly these nodes exist."""
        seen = set()
        for node in nodes:
            seen.add(str(node["metadata"]["name"]))
            self.upsert_node(node, now)
        for name in self.nodes.names() - seen:
            self.delete_node(name)
        self.nodes.synced = True

    def sweep_heartbeats(self, now: datetime) -> list[str]:
        """:meth:`NodeBook.sweep`, each node whose standing changed re-counted."""
        changed = self.nodes.sweep(now)
        for name in changed:
            self.pods.recount(name)
        return changed

    # ----------------------------------------------------------------------------------------------
    # Pods (PodBook)

    def upsert_pod(self, pod: JsonObject) -> None:
        self.pods.upsert(pod)

    def upsert_read_pod(self, pod: JsonObject) -> bool:
        return self.pods.upsert_read(pod)

    def delete_pod(self, uid: str) -> None:
        self.pods.delete(uid)

    def mark(self) -> int:
        return self.pods.mark()

    def replace_pods(self, pods: Iterable[JsonObject], listed: int | None = None) -> None:
        self.pods.replace(pods, listed)

    def assume(self, decided: PodAllocation) -> None:
        self.pods.assume(decided)

    def bind_answered(self, uid: str) -> None:
        self.pods.bind_answered(uid)

    def forget(self, uid: str, allocation: Allocation) -> None:
        self.pods.forget(uid, allocation)

    def counts(self, uid: str) -> bool:
        return self.pods.counts(uid)

    def counted_as(self, uid: str) -> PodAllocation | None:
        return self.pods.counted_as(uid)

    def pods_on(self, node: str) -> list[PodAllocation]:
        return self.pods.pods_on(node)

    def resizing(self, uid: str, allocation: Allocation) -> None:
        self.pods.resizing(uid, allocation)

    def resize_failed(self, uid: str) -> None:
        self.pods.resize_failed(uid)

    # ----------------------------------------------------------------------------------------------
    # Reservations

    def reserve(self, reserved: PodAllocation, now: datetime, fit: NodeFit | None = None) -> None:
        self.reservations.reserve(reserved, now, fit)

    def reservation(self, uid: str) -> PodAllocation | None:
        return self.reservations.reservation(uid)

    def unreserve(self, uid: str) -> None:
        self.pods.unreserve(uid)

    def confirm_reservation(self, uid: str, node: str, phase: str, now: datetime) -> PodAllocation | None:
        return self.reservations.confirm(uid, node, phase, now)

    def expire_reservations(self, now: datetime) -> None:
        self.reservations.expire(now)

    # ----------------------------------------------------------------------------------------------
    # Pods in flight (InflightBook)

    def inflight_pods(self, node: str, now: datetime, timeout: timedelta) -> InflightPods:
        return self.inflight.pods(node, now, timeout)

    def nodes_with_inflight(self) -> AbstractSet[str]:
        return self.inflight.nodes()

    def keeping_inflight_rule(
        self,
        fit: NodeFit,
        shape: PodShape,
        policy: PlacementPolicy,
        *,
        uid: str,
        now: datetime,
        timeout: timedelta,
    ) -> NodeFit | str:
        return self.inflight.keeping_rule(fit, shape, policy, uid=uid, now=now, timeout=timeout)

    # ----------------------------------------------------------------------------------------------
    # What the verbs ask of the placement engine (CountedNodes)

    def node_count(self) -> int:
        return self.counted.node_count()

    def knows_node(self, name: str) -> bool:
        return self.counted.knows(name)

    def node(self, name: str) -> NodeState | None:
        return self.counted.node(name)

    def candidates(self, names: Sequence[str], unknown_kept: int) -> Sequence[str]:
        return self.counted.candidates(names, unknown_kept)

    def evaluate(self, shape: PodShape, names: Iterable[str]) -> Evaluation:
        return self.counted.evaluate(shape, names)

    def choose_victims(
        self, name: str, shape: PodShape, priority: int, budgets: Sequence[Budget], max_sets: int
    ) -> Preemption | str:
        """:meth:`CountedNodes.choose_victims` among the pods kube-scheduler could evict there."""
        return self.counted.choose_victims(
            name, self.pods.evictable_on(name), shape, priority, budgets=budgets, max_sets=max_sets
        )

    def placed(self, shape: PodShape) -> None:
        self.counted.placed(shape)

    def oversubscribed_gpus(self) -> int:
        return self.counted.oversubscribed_gpus()


class NotSyncedError(RuntimeError):
    """The caches are not yet filled from the API server (just started): deciding now could give
    away capacity that pods already hold, so every verb refuses until they are."""


def require_synced(state: ClusterState) -> None:
    missing = state.unsynced()
    if missing:
        raise NotSyncedError(f"tessera extender is starting: caches not synced ({', '.join(missing)})")
