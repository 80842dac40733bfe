"""The pod book: one record per pod that counts (docs/placement.md, "State"), and the nodes they count on.

An allocation decided at bind is *assumed* at once, before the API server echoes it back through
the watch, so the next pod never sees the capacity as free; the assumption ends when the watch shows
the pod bound, when the pod goes, or when the bind fails. An allocation on a pod that is not bound
holds nothing. A *reservation* is an assumption made at filter, for a short time
(:class:`extender.reservations.Reservations`). A live resize being written counts each grant at the
larger of its two quotas until the watch shows it.

Every change re-counts the nodes concerned: their pods in flight (:class:`InflightBook`) and their
state in the engine (:class:`CountedNodes`); a change of a pod's allocation or phase is told to
:class:`PodChanges`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from extender.countednodes import CountedNodes
from extender.inflightbook import InflightBook
from extender.podchanges import PodChanges
from extender.podrecords import PodAllocation, PodRecord, parse_pod, resource_version, with_resize
from tessera.contract import Allocation, ContractKeys, JsonObject
from tessera.inflight import is_allocating
from tessera.placement import NodeFit

# UIDs of pods the API server has shown gone, kept so that a read answered before the deletion but
# applied after it cannot bring the pod back (a UID is never reused). A read is applied within
# seconds of being served; this many deletions take far longer on any cluster.
REMEMBERED_GONE = 65536


class PodBook:
    def __init__(
        self, keys: ContractKeys, counted: CountedNodes, inflight: InflightBook, changes: PodChanges
    ) -> None:
        self.keys = keys
        self.counted = counted
        self.inflight = inflight
        self.changes = changes
        self._pods: dict[str, PodRecord] = {}  # by UID: every pod that counts or is remembered
        # Kept by reindex alone: the UIDs of the pods counted on each node.
        self._pods_on: dict[str, set[str]] = {}
        # Live resizes being written, by pod UID: counted with the pod's allocation, each grant at
        # the larger of the two, until the API server shows the pod with it (see resizing).
        self._resizes: dict[str, Allocation] = {}
        # Pods shown gone (REMEMBERED_GONE), oldest first.
        self._gone: OrderedDict[str, None] = OrderedDict()
        # A counter ordering relists and binds' answers (see replace).
        self._marks = 0
        self.synced = False  # filled by a first list

    # ----------------------------------------------------------------------------------------------
    # The API server's word

    def upsert(self, pod: JsonObject) -> None:
        """The pod as the watch (or a relist) shows it."""
        metadata = pod.get("metadata") or {}
        uid = str(metadata.get("uid"))
        if uid in self._gone:
            return  # a UID never comes back: an event about a pod after its deletion is late news
        parsed = parse_pod(pod, self.keys)
        resized = self._resizes.get(uid)
        if resized is not None and (parsed is None or parsed.allocation == resized):
            self._end_resize(uid)  # written (or the pod is gone): the API server's word holds
        record = self._pods.get(uid)
        if record is None:
            if parsed is None:
                return  # holds nothing, and never did
            record = self._pods[uid] = PodRecord()
        record.version = resource_version(metadata)
        if record.assumed is None and record.observed == parsed:
            return  # nothing that counts changed (most pod events: status, other annotations)
        assumed = record.assumed
        if (
            parsed is not None
            and assumed is not None
            and record.reserved_at is None
            and (parsed.allocation, parsed.phase) == (assumed.allocation, assumed.phase)
        ):
            # The watch echoing a bind: the node's usage is the same; only the record (and its
            # bind time, to the second) comes from the API server now.
            record.observed = parsed
            record.assumed = None
            record.answered = None
            self.refresh_inflight(parsed.allocation.node)
            return
        touched = record.nodes()
        record.observed = parsed
        if parsed is not None:
            # Bound with the assumed allocation, or moved on by someone else (device plugin): the
            # API server's word now holds.
            record.assumed = None
            record.reserved_at = None
            record.answered = None
        self.reindex(uid, touched)

    def upsert_read(self, pod: JsonObject) -> bool:
        """The pod as a read of the API server (a list or a get, not the watch) shows it; whether it
        was applied.

        The read may answer before, and be applied after, watch events that came later: the pod's
        deletion (the read would bring back a pod that no event will ever remove again) or a newer
        version (its phase moved on). Such a read is not applied.
        """
        metadata = pod.get("metadata") or {}
        uid = str(metadata.get("uid"))
        if uid in self._gone:
            return False
        record = self._pods.get(uid)
        read = resource_version(metadata)
        if record is not None and record.version is not None and read is not None and read < record.version:
            return False
        self.upsert(pod)
        return True

    def delete(self, uid: str) -> None:
        """The pod is gone from the API server (for good: UIDs are not reused)."""
        self._gone[uid] = None
        if len(self._gone) > REMEMBERED_GONE:
            self._gone.popitem(last=False)
        self._end_resize(uid)
        record = self._pods.get(uid)
        if record is None:
            return
        touched = record.nodes()
        record.observed = record.assumed = record.reserved_at = None
        self.reindex(uid, touched)

    def mark(self) -> int:
        """A new mark: marks order relists (taken as a list is requested) and binds' answers."""
        self._marks += 1
        return self._marks

    def replace(self, pods: Iterable[JsonObject], listed: int | None = None) -> None:
        """After a (re)list requested at mark ``listed`` (None: the list is newer than every bind's
        answer): exactly these pods exist, but for binds the list may not show yet (answered after
        it was requested, or not yet), whose assumptions stay; assumptions for pods still there are
        kept too."""
        seen = set()
        for pod in pods:
            seen.add(str((pod.get("metadata") or {}).get("uid")))
            self.upsert(pod)
        for uid in set(self._pods) - seen:
            record = self._pods[uid]
            if (
                record.binding
                and listed is not None
                and (record.answered is None or record.answered > listed)
            ):
                continue
            if record.observed is not None or record.reserved_at is None:
                self.delete(uid)
            else:
                self.unreserve(uid)  # a pod not bound yet may still be: not gone for good
        self.synced = True

    # ----------------------------------------------------------------------------------------------
    # The extender's own decisions

    def assume(self, decided: PodAllocation) -> None:
        """Count ``decided`` now (decided at bind, not yet seen through the watch)."""
        record = self.hold(decided.uid)
        touched = record.nodes()
        record.assumed = decided
        record.reserved_at = None
        record.answered = None
        self.reindex(decided.uid, touched)

    def bind_answered(self, uid: str) -> None:
        """The bind of ``uid`` got its answer (success: the pod's assumption waits for the watch)."""
        record = self._pods.get(uid)
        if record is not None and record.binding:
            record.answered = self.mark()

    def forget(self, uid: str, allocation: Allocation) -> None:
        """Undo :meth:`assume` of ``allocation`` after a failed bind (and the observed copy of it)."""
        record = self._pods.get(uid)
        if record is None:
            return
        touched = record.nodes()
        if record.assumed is not None and record.assumed.allocation == allocation:
            record.assumed = record.reserved_at = None
        if record.observed is not None and record.observed.allocation == allocation:
            record.observed = None
        self.reindex(uid, touched)

    def unreserve(self, uid: str) -> None:
        """Drop the pod's reservation, if it has one (and no bind decision yet)."""
        record = self._pods.get(uid)
        if record is None or record.reserved_at is None:
            return
        touched = record.nodes()
        record.assumed = record.reserved_at = None
        self.reindex(uid, touched)

    def resizing(self, uid: str, allocation: Allocation) -> None:
        """Count ``allocation``, a live resize of pod ``uid`` being written, from now on: with the pod's
        current allocation, each grant at the larger of the two (neither a grow nor a shrink frees
        anything before the API server has the new one), until the watch shows the pod with it, the
        pod goes, or :meth:`resize_failed`."""
        self._resizes[uid] = allocation
        self.recount(allocation.node)

    def resize_failed(self, uid: str) -> None:
        """The resize of pod ``uid`` was not written: count its allocation alone again."""
        self._end_resize(uid)

    def _end_resize(self, uid: str) -> None:
        allocation = self._resizes.pop(uid, None)
        if allocation is not None:
            self.recount(allocation.node)

    # ----------------------------------------------------------------------------------------------
    # Reading

    def counts(self, uid: str) -> bool:
        """Whether the pod is counted at all (observed with an allocation, assumed or reserved)."""
        return uid in self._pods

    def counted_as(self, uid: str) -> PodAllocation | None:
        """The pod's allocation as counted now (the API server's word, or a decision not yet seen)."""
        record = self._pods.get(uid)
        return None if record is None else record.counted

    def record(self, uid: str) -> PodRecord | None:
        return self._pods.get(uid)

    def hold(self, uid: str) -> PodRecord:
        """The pod's record, a new one if it has none (reindex drops it again if nothing counts)."""
        return self._pods.setdefault(uid, PodRecord())

    def pods_on(self, node: str) -> list[PodAllocation]:
        found = (self._pods[uid].counted for uid in self._pods_on.get(node, ()))
        return [p for p in found if p is not None]

    def evictable_on(self, node: str) -> list[PodAllocation]:
        """The pods on ``node`` kube-scheduler could evict: bound (a reservation is no pod yet), not
        being deleted already."""
        return [p for p in self.pods_on(node) if not p.terminating and self._pods[p.uid].reserved_at is None]

    def in_flight(self, pod: PodAllocation) -> bool:
        """Bound and not yet served by the device plugin (phase allocating), or reserved."""
        return is_allocating(pod.phase) or self._pods[pod.uid].reserved_at is not None

    # ----------------------------------------------------------------------------------------------
    # Re-counting nodes

    def reindex(self, uid: str, before: set[str], placed: NodeFit | None = None) -> None:
        """Re-count pod ``uid`` on the nodes it counted on (``before``) and counts on now. ``placed``
        is the fit its new allocation came from, when it has one."""
        record = self._pods.get(uid)
        counted = None if record is None else record.counted
        after = set() if record is None else record.nodes()
        on = {counted.allocation.node} if counted is not None else set()
        for node in before - on:
            uids = self._pods_on.get(node)
            if uids is not None:
                uids.discard(uid)
                if not uids:
                    del self._pods_on[node]
        for node in on:
            self._pods_on.setdefault(node, set()).add(uid)
        if record is not None and counted is None:
            del self._pods[uid]  # nothing left to remember
        for node in before | after:
            if not before and placed is not None and self.counted.node(node) == placed.node:
                # A pod counted nowhere before, on a node as its fit saw it: add the placement.
                self.refresh_inflight(node)
                self.counted.add(placed)
            else:
                self.recount(node)
        self.changes.changed()

    def refresh_inflight(self, node: str) -> list[PodAllocation]:
        """Tell the in-flight book the pods in flight on ``node`` (before any change of its state:
        what was derived from them goes too); returns all its pods."""
        pods = self.pods_on(node)
        self.inflight.refresh(node, [p for p in pods if self.in_flight(p)])
        return pods

    def recount(self, node: str) -> None:
        """Count the node's pods on it anew (its pods changed, or its Node did)."""
        pods = self.refresh_inflight(node)
        allocations = [with_resize(p.allocation, self._resizes.get(p.uid)) for p in pods]
        self.counted.rebuild(node, pods, allocations, self.in_flight)
