"""The in-flight book: each node's pods in flight (phase allocating, or reserved: their bind is on its
way), and the in-flight rule's answers there (docs/placement.md, "Bind").

The pod book tells it a node's pods in flight whenever they may have changed (:meth:`InflightBook.refresh`);
what follows from them (the pods in flight as of a moment, the rule's answers) is made anew then.
"""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from extender.podrecords import PodAllocation
from tessera.inflight import InflightKey, stale
from tessera.placement import NodeFit, PlacementEngine, PlacementPolicy, PodShape, fit_keeping_inflight_rule

# In-flight rule answers kept per node (until its state or its pods in flight change).
REMEMBERED_VETTINGS = 256


@dataclass(frozen=True, slots=True)
class InflightPods:
    """The pods in flight on a node, as of some moment: container keys and names by pod UID. The
    same until one of them times out (``until``) or the node's pods change."""

    keys: dict[str, tuple[InflightKey, ...]]  # by pod ref ("namespace/name")
    names: dict[str, str]  # pod refs by pod UID
    timeout: timedelta
    until: datetime | None

    def without(self, uid: str) -> dict[str, tuple[InflightKey, ...]]:
        """The keys of the pods other than ``uid``."""
        name = self.names.get(uid)
        if name is None:
            return self.keys
        return {pod: keys for pod, keys in self.keys.items() if pod != name}


# (shape, policy name, context version or -1, the UID left out of the pods in flight or "")
_Question = tuple[PodShape, str, int, str]


@dataclass(slots=True)
class _Inflight:
    """The pods in flight on one node, and what follows from them: made anew whenever the node's
    pods or its state change."""

    pods: list[PodAllocation]
    # As of the last question (see InflightBook.pods), until one of them times out.
    current: InflightPods | None = None
    # The in-flight rule's answers for ``current`` (see InflightBook.keeping_rule).
    vetted: dict[_Question, NodeFit | str] = field(default_factory=dict)


class InflightBook:
    def __init__(self, engine: PlacementEngine) -> None:
        """``engine``: whose profiles and context the rule's answers are made with."""
        self.engine = engine
        self._inflight: dict[str, _Inflight] = {}

    def refresh(self, node: str, pods: list[PodAllocation]) -> None:
        """``pods`` are now the pods in flight on ``node`` (before any change of its state: what was
        derived from the ones before goes too)."""
        if pods:
            self._inflight[node] = _Inflight(pods)
        else:
            self._inflight.pop(node, None)

    def nodes(self) -> AbstractSet[str]:
        """Nodes with a pod in phase allocating (however old) or reserved: where filter checks the
        in-flight rule. A live view, not a copy (hundreds of nodes while pods are being admitted):
        membership tests on it are safe while the watch changes it."""
        return self._inflight.keys()

    def everywhere(self) -> Iterator[PodAllocation]:
        """Every pod in flight, on every node (reserved pods among them: no walk over every pod)."""
        for entry in self._inflight.values():
            yield from entry.pods

    def pods(self, node: str, now: datetime, timeout: timedelta) -> InflightPods:
        """The pods in flight on ``node`` at ``now`` (phase allocating or reserved, bound less than
        ``timeout`` ago): one object for as long as they stay the same (filter asks about the same
        nodes pod after pod; see keeping_rule)."""
        entry = self._inflight.get(node)
        if entry is None:
            return InflightPods({}, {}, timeout, None)
        known = entry.current
        if known is not None and known.timeout == timeout and (known.until is None or now <= known.until):
            return known
        live = tuple(
            p for p in entry.pods if p.bind_time is not None and not stale(p.bind_time, now, timeout)
        )
        # Until the first of them times out (none comes back: bind times only age).
        until = min((p.bind_time + timeout for p in live if p.bind_time is not None), default=None)
        entry.current = InflightPods(
            {p.ref: p.keys for p in live}, {p.uid: p.ref for p in live}, timeout, until
        )
        entry.vetted.clear()  # answers for the pods in flight before
        return entry.current

    def keeping_rule(
        self,
        fit: NodeFit,
        shape: PodShape,
        policy: PlacementPolicy,
        *,
        uid: str,
        now: datetime,
        timeout: timedelta,
    ) -> NodeFit | str:
        """``fit`` (of ``shape`` under ``policy``, from the engine's current state) if pod ``uid``
        may be in flight on its node with the pods in flight there at ``now``; else the fit there
        that joins their in-flight key; else why not (the in-flight rule).

        While a node's pods stay in flight, every pod of a shape asks the same question there: the
        answers are kept with the node's pods in flight, which are made anew when they change, when
        one of them times out, or when the node's state changes.
        """
        pods = self.pods(fit.name, now, timeout)
        others = pods.without(uid)
        if not others:
            return fit
        entry = self._inflight[fit.name]
        version = self.engine.context.version if policy.uses_context else -1
        question = (shape, policy.name, version, uid if uid in pods.names else "")
        known = entry.vetted.get(question)
        if known is not None:
            return known
        answer = fit_keeping_inflight_rule(
            fit,
            shape,
            profiles=self.engine.profiles,
            policy=policy,
            context=self.engine.context,
            inflight=others,
        )
        if len(entry.vetted) >= REMEMBERED_VETTINGS:
            entry.vetted.clear()  # not an LRU: hits stay free, and a refill is cheap
        entry.vetted[question] = answer
        return answer
